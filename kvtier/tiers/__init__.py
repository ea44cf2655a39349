"""Storage tiers: the protocol (base.py) and one folder per tier (config.py + tier.py).

Tier kinds are found by name in ``TIER_KINDS`` (configs) and ``TIER_CLASSES`` (tiers), lazy registries:
importing this package imports no tier, and a tier's modules (and its client library: redis-py, Mooncake)
are imported only when its config is read or it is built. The config and tier classes re-exported here load
on first access too.
"""

from typing import TYPE_CHECKING

from kvtier.base.registry import lazy_exports
from kvtier.tiers.base import (
    TIER_CLASSES,
    TIER_KINDS,
    BoundedGets,
    ChainOrdered,
    EvictionListener,
    EvictionReporter,
    Flushable,
    LargeLoadWindows,
    Listable,
    RemovalListener,
    RemovalReporter,
    SharedStore,
    Tier,
    TierConfig,
    TierContext,
    TierStats,
    WriteMode,
    register_tier,
    register_tier_kind,
    stats_gauges,
)

__getattr__ = lazy_exports(__name__, globals(), {
    "DiskTier": "kvtier.tiers.disk.tier", "DiskTierConfig": "kvtier.tiers.disk.config",
    "MemoryTier": "kvtier.tiers.memory.tier", "MemoryTierConfig": "kvtier.tiers.memory.config",
    "MooncakeTier": "kvtier.tiers.mooncake.tier", "MooncakeTierConfig": "kvtier.tiers.mooncake.config",
    "RedisTier": "kvtier.tiers.redis.tier", "RedisTierConfig": "kvtier.tiers.redis.config",
})

if TYPE_CHECKING:
    from kvtier.tiers.disk.config import DiskTierConfig
    from kvtier.tiers.disk.tier import DiskTier
    from kvtier.tiers.memory.config import MemoryTierConfig
    from kvtier.tiers.memory.tier import MemoryTier
    from kvtier.tiers.mooncake.config import MooncakeTierConfig
    from kvtier.tiers.mooncake.tier import MooncakeTier
    from kvtier.tiers.redis.config import RedisTierConfig
    from kvtier.tiers.redis.tier import RedisTier

__all__ = [
    "TIER_CLASSES", "TIER_KINDS", "BoundedGets", "ChainOrdered", "DiskTier", "DiskTierConfig", "EvictionListener",
    "EvictionReporter", "Flushable", "LargeLoadWindows", "Listable", "MemoryTier", "MemoryTierConfig",
    "MooncakeTier", "MooncakeTierConfig", "RedisTier", "RedisTierConfig", "RemovalListener", "RemovalReporter",
    "SharedStore", "Tier", "TierConfig", "TierContext", "TierStats", "WriteMode", "register_tier",
    "register_tier_kind", "stats_gauges",
]
