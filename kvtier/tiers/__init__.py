"""Storage tiers. Each kind registers its config class in ``TIER_KINDS`` on import."""

from kvtier.tiers.base import (
    TIER_KINDS,
    EvictionListener,
    Tier,
    TierConfig,
    TierContext,
    TierStats,
    WriteMode,
    contains_prefix,
    register_tier,
    stats_gauges,
)
from kvtier.tiers.disk import DiskTier, DiskTierConfig
from kvtier.tiers.memory import MemoryTier, MemoryTierConfig
from kvtier.tiers.redis import RedisTier, RedisTierConfig  # redis-py is imported only when a tier is built

__all__ = [
    "TIER_KINDS", "DiskTier", "DiskTierConfig", "EvictionListener", "MemoryTier", "MemoryTierConfig", "RedisTier",
    "RedisTierConfig", "Tier",
    "TierConfig", "TierContext", "TierStats", "WriteMode", "contains_prefix", "register_tier",
]
