"""The memory tier: chunks in one preallocated host (or device) buffer, evicted by a policy (config.py: its
config; tier.py: the tier, imported when first used)."""

from typing import TYPE_CHECKING

from kvtier.base.registry import lazy_exports

__getattr__ = lazy_exports(__name__, globals(), {
    "MemoryTier": "kvtier.tiers.memory.tier", "MemoryTierConfig": "kvtier.tiers.memory.config"})

if TYPE_CHECKING:
    from kvtier.tiers.memory.config import MemoryTierConfig
    from kvtier.tiers.memory.tier import MemoryTier

__all__ = ["MemoryTier", "MemoryTierConfig"]
