"""kvtier: a tiered prefix KV cache for LLM serving."""

from kvtier.cache import KVCache, KVSink, KVSource, TensorSink, TensorSource
from kvtier.config import CacheConfig
from kvtier.errors import BlobError, CodecError, ConfigError, InvalidArgument, KVTierError, TierError
from kvtier.keys import ChunkHash, Namespace
from kvtier.layout import KVSpec
from kvtier.metrics import Metrics
from kvtier.state import ModelStateSpec, SnapshotPolicy, StateKind, StateSpec
from kvtier.state_cache import PrefixState

__version__ = "0.1.0"

__all__ = [
    "BlobError", "CacheConfig", "ChunkHash", "CodecError", "ConfigError", "InvalidArgument", "KVCache", "KVSink",
    "KVSource", "KVSpec", "KVTierError", "Metrics", "ModelStateSpec", "Namespace", "PrefixState", "SnapshotPolicy",
    "StateKind", "StateSpec", "TensorSink", "TensorSource", "TierError",
]
