"""Local-disk tier: one file per chunk (see tier.py for its design, files.py for its on-disk layout)."""

from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.tier import DiskTier

__all__ = ["DiskTier", "DiskTierConfig"]
