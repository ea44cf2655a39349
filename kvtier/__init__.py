"""kvtier: a tiered prefix KV cache for LLM serving.

The public names below load on first use, so ``import kvtier`` (and ``kvtier --help``) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.base.registry import lazy_exports

__version__ = "0.1.0"

#: public name -> the module that defines it
_PUBLIC: dict[str, str] = {
    **dict.fromkeys(("BlobError", "CodecError", "ConfigError", "InvalidArgument", "KVTierError", "NotSupported",
                     "PinBudgetExceeded", "TierError"), "kvtier.base.errors"),
    **dict.fromkeys(("ChunkHash", "Namespace"), "kvtier.base.keys"),
    "KVSpec": "kvtier.base.layout",
    "Metrics": "kvtier.base.metrics",
    **dict.fromkeys(("ModelStateSpec", "SnapshotPolicy", "StateKind", "StateSpec"), "kvtier.base.state"),
    **dict.fromkeys(("KVCache", "KVSink", "KVSource", "TensorSink", "TensorSource"), "kvtier.core.cache"),
    "CacheConfig": "kvtier.core.config",
    "CacheControl": "kvtier.core.control",
    "TierUsage": "kvtier.tiers.control",
    "PrefixState": "kvtier.core.snapshots",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_exports(__name__, globals(), _PUBLIC)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from kvtier.base.errors import (
        BlobError,
        CodecError,
        ConfigError,
        InvalidArgument,
        KVTierError,
        NotSupported,
        PinBudgetExceeded,
        TierError,
    )
    from kvtier.base.keys import ChunkHash, Namespace
    from kvtier.base.layout import KVSpec
    from kvtier.base.metrics import Metrics
    from kvtier.base.state import ModelStateSpec, SnapshotPolicy, StateKind, StateSpec
    from kvtier.core.cache import KVCache, KVSink, KVSource, TensorSink, TensorSource
    from kvtier.core.config import CacheConfig
    from kvtier.core.control import CacheControl
    from kvtier.core.snapshots import PrefixState
    from kvtier.tiers.control import TierUsage
