"""Shared tier on Redis or Valkey (see tier.py for its keys, values, capacity and failure handling).

redis-py is imported only when a tier is built, so ``import kvtier`` works without it.
"""

from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.redis.tier import RedisTier

__all__ = ["RedisTier", "RedisTierConfig"]
