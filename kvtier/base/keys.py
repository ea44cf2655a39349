"""Chunk keys: everything that changes the KV bytes, chained over fixed-size token chunks.

Contract
--------
* ``Namespace.root`` is SHA-256 over a typed, length-prefixed encoding of every field, so no two distinct
  namespaces can encode to the same bytes.
* ``chunk_hashes(root, tokens, chunk_size)`` returns ``h_1 .. h_n`` for the ``n = len(tokens) // chunk_size``
  *full* chunks: ``h_i = SHA-256(h_{i-1} || u32 len || tokens of chunk i as little-endian u32)``, ``h_0 = root``.
  A partial last chunk (fewer than ``chunk_size`` tokens) gets no key: it is never stored and is recomputed
  by the engine. So two requests sharing their first ``m`` tokens share exactly ``m // chunk_size`` keys.
* Pure functions: the result depends only on the arguments, identical across processes and machines.

The codec is deliberately *not* part of the chain: a codec changes the stored bytes, not the KV they decode
to. Each tier keeps its codec in its storage key and in every blob header, so entries written with one codec
are never read as another, and a chunk can move between tiers of different codecs (write-back, promotion)
knowing only its key.

Segment keys (non-prefix reuse) name the KV of one segment computed alone, its first token at a fixed base
position: ``SHA-256(segment_root || u32 base_position || u32 len || tokens as little-endian u32)``, where
``segment_root = SHA-256("kvtier/segment/v1" || namespace encoding)``. The distinct domain string makes
``segment_root`` differ from every namespace root and chunk hash, so a segment key never names a prefix
chunk (and the reverse) while both live in the same tiers; namespace and tenant salt enter as for chunks.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.base.errors import ConfigError, InvalidArgument
from kvtier.base.hashes import HASH_BYTES, ChunkHash
from kvtier.base.layout import KVSpec

if TYPE_CHECKING:
    from kvtier.base.state import ModelStateSpec

_DOMAIN = b"kvtier/namespace/v1"
_SEGMENT_DOMAIN = b"kvtier/segment/v1"
_U32 = struct.Struct("<I")

Tokens = Sequence[int] | np.ndarray | torch.Tensor


def _field(name: str, value: str | int | bytes) -> bytes:
    """Typed, length-prefixed encoding of one named field."""
    if isinstance(value, bool):  # bool is an int; keep it distinct
        raise TypeError(f"namespace field {name} must not be a bool")
    if isinstance(value, str):
        tag, raw = b"s", value.encode("utf-8")
    elif isinstance(value, int):
        tag, raw = b"i", value.to_bytes(8, "little", signed=True)
    elif isinstance(value, bytes):
        tag, raw = b"b", value
    else:
        raise TypeError(f"namespace field {name} has unsupported type {type(value).__name__}")
    key = name.encode("ascii")
    return _U32.pack(len(key)) + key + tag + _U32.pack(len(raw)) + raw


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the KV bytes of a token sequence, except the codec (see module docstring).

    ``model`` names the weights exactly: a name plus revision, or a fingerprint of the config and weights.
    ``salt`` separates tenants; it must come from the server's idea of the caller, never from a request body.
    ``spec`` is the attention KV spec, or a ModelStateSpec for models with state beyond KV (SSM layers).
    """

    model: str
    spec: KVSpec | ModelStateSpec
    chunk_size: int
    tp_rank: int = 0
    tp_size: int = 1
    adapter: str = ""
    salt: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("Namespace.model must name the model (and its revision)")
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not isinstance(self.salt, bytes):
            raise ConfigError("salt must be bytes")

    def encode(self) -> bytes:
        """The exact bytes hashed into ``root``."""
        fields = [
            _field("model", self.model),
            *(_field(name, value) for name, value in self.spec.key_fields()),
            _field("chunk_size", self.chunk_size),
            _field("tp_rank", self.tp_rank),
            _field("tp_size", self.tp_size),
            _field("adapter", self.adapter),
            _field("salt", self.salt),
        ]
        return _DOMAIN + b"".join(fields)

    @cached_property
    def root(self) -> ChunkHash:
        """``h_0``: the digest every chunk chain of this namespace starts from."""
        return ChunkHash(hashlib.sha256(self.encode()).digest())

    def with_salt(self, salt: bytes) -> Namespace:
        if salt == self.salt:
            return self
        return Namespace(self.model, self.spec, self.chunk_size, self.tp_rank, self.tp_size, self.adapter, salt)

    def chunk_hashes(self, tokens: Tokens) -> list[ChunkHash]:
        return chunk_hashes(self.root, tokens, self.chunk_size)

    @cached_property
    def segment_root(self) -> ChunkHash:
        """The root of this namespace's segment keys (a separate key domain, see module docstring)."""
        return ChunkHash(hashlib.sha256(_SEGMENT_DOMAIN + self.encode()).digest())

    def segment_hash(self, tokens: Tokens, base_position: int) -> ChunkHash:
        """The key of the KV of ``tokens`` computed alone, the first at position ``base_position``."""
        data = token_array(tokens)
        h = hashlib.sha256(self.segment_root)
        h.update(_U32.pack(base_position))
        h.update(_U32.pack(len(data)))
        h.update(memoryview(data).cast("B"))
        return ChunkHash(h.digest())


def token_array(tokens: Tokens) -> np.ndarray:
    """Tokens as a contiguous little-endian uint32 array; raises InvalidArgument for ids outside [0, 2**32)."""
    if isinstance(tokens, torch.Tensor):
        arr = tokens.detach().cpu().reshape(-1).numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens.reshape(-1)
    else:
        try:  # array('I') is the fastest exact conversion of a Python list, and rejects negatives itself
            packed = array.array("I", tokens)
        except (OverflowError, TypeError) as exc:
            raise InvalidArgument(f"token ids must be integers in [0, 2**32): {exc}") from None
        if sys.byteorder != "little":
            packed.byteswap()
        return np.frombuffer(packed, dtype="<u4")
    if arr.dtype == np.dtype("<u4"):
        return np.ascontiguousarray(arr)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise InvalidArgument("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def chunk_hashes(root: ChunkHash, tokens: Tokens, chunk_size: int) -> list[ChunkHash]:
    """Chained hashes of the full chunks of ``tokens`` (see module docstring)."""
    data = memoryview(token_array(tokens)).cast("B")
    step = chunk_size * 4
    n_full = len(data) // step
    length = _U32.pack(chunk_size)
    sha256 = hashlib.sha256
    out: list[ChunkHash] = []
    prev = bytes(root)
    for i in range(n_full):
        h = sha256(prev)
        h.update(length)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(ChunkHash(prev))
    return out

__all__ = ["HASH_BYTES", "ChunkHash", "Namespace", "Tokens", "chunk_hashes", "token_array"]
