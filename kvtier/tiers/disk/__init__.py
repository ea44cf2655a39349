"""Local-disk tier: one file per chunk (see tier.py for its design, files.py for its on-disk layout).

The tier's modules are imported when first used; its config (config.py) never imports them.
"""

from typing import TYPE_CHECKING

from kvtier.base.registry import lazy_exports

__getattr__ = lazy_exports(__name__, globals(), {
    "DiskTier": "kvtier.tiers.disk.tier", "DiskTierConfig": "kvtier.tiers.disk.config"})

if TYPE_CHECKING:
    from kvtier.tiers.disk.config import DiskTierConfig
    from kvtier.tiers.disk.tier import DiskTier

__all__ = ["DiskTier", "DiskTierConfig"]
