"""The ``mooncake`` tier kind: a Mooncake Store pool of every replica's spare memory (see tier.py).

The tier's modules are imported when first used and the ``mooncake`` engine package only when a tier is
built; the config (config.py) never imports the tier.
"""

from typing import TYPE_CHECKING

from kvtier.base.registry import lazy_exports

__getattr__ = lazy_exports(__name__, globals(), {
    "MooncakeTier": "kvtier.tiers.mooncake.tier", "MooncakeTierConfig": "kvtier.tiers.mooncake.config",
    "TransferProtocol": "kvtier.tiers.mooncake.config"})

if TYPE_CHECKING:
    from kvtier.tiers.mooncake.config import MooncakeTierConfig, TransferProtocol
    from kvtier.tiers.mooncake.tier import MooncakeTier

__all__ = ["MooncakeTier", "MooncakeTierConfig", "TransferProtocol"]
