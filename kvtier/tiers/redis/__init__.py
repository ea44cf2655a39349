"""Shared tier on Redis or Valkey (see tier.py for its keys, values, capacity and failure handling).

The tier's modules are imported when first used, and redis-py only when a tier is built, so ``import kvtier``
works without it; the config (config.py) never imports the tier.
"""

from typing import TYPE_CHECKING

from kvtier.base.registry import lazy_exports

__getattr__ = lazy_exports(__name__, globals(), {
    "RedisTier": "kvtier.tiers.redis.tier", "RedisTierConfig": "kvtier.tiers.redis.config"})

if TYPE_CHECKING:
    from kvtier.tiers.redis.config import RedisTierConfig
    from kvtier.tiers.redis.tier import RedisTier

__all__ = ["RedisTier", "RedisTierConfig"]
