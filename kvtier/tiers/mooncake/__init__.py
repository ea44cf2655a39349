"""The ``mooncake`` tier kind: a Mooncake Store pool of every replica's spare memory (see tier.py).

Importing this registers the kind; the ``mooncake`` engine package is imported only when a tier is built.
"""

from kvtier.tiers.mooncake.config import MooncakeTierConfig, TransferProtocol
from kvtier.tiers.mooncake.tier import MooncakeTier

__all__ = ["MooncakeTier", "MooncakeTierConfig", "TransferProtocol"]
