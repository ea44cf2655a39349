"""Storage tiers: the protocol (base.py) and one module or folder per tier. Importing a tier registers its
config class in ``TIER_KINDS``."""

from kvtier.tiers.base import (
    TIER_KINDS,
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
    stats_gauges,
)
from kvtier.tiers.disk import DiskTier, DiskTierConfig
from kvtier.tiers.memory import MemoryTier, MemoryTierConfig
from kvtier.tiers.mooncake import MooncakeTier, MooncakeTierConfig  # the engine is imported only when built
from kvtier.tiers.redis import RedisTier, RedisTierConfig  # redis-py is imported only when a tier is built

__all__ = [
    "TIER_KINDS", "ChainOrdered", "DiskTier", "DiskTierConfig", "EvictionListener", "EvictionReporter",
    "Flushable", "LargeLoadWindows", "Listable", "MemoryTier", "MemoryTierConfig", "MooncakeTier",
    "MooncakeTierConfig", "RedisTier", "RedisTierConfig", "RemovalListener", "RemovalReporter", "SharedStore",
    "Tier", "TierConfig", "TierContext", "TierStats", "WriteMode", "register_tier", "stats_gauges",
]
