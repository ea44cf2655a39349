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

Extra keys per span
-------------------
Tokens do not always say everything that changes KV: an image or audio input becomes placeholder token ids that
are the same for every image of that size, a prompt given as embeddings has placeholder ids (zeros), a LoRA
adapter changes every position. :class:`ExtraKeys` holds, per such input, a :class:`SpanKey`: its kind, the
token span ``[start, end)`` it covers, and a value that identifies it (a multimodal hash, a digest of the
embedding bytes of the span, an adapter name). ``chunk_hashes(root, tokens, chunk_size, extras)`` folds into
chunk ``i`` the spans that overlap it, in ``ExtraKeys`` order:
``h_i = SHA-256(h_{i-1} || u32 len || tokens || "kvtier/extra/v1" || u32 count || span encodings)``, a span
encoding being ``u32 len || kind || u64 start || u64 end || u32 len || value``. Through the chain every later
chunk differs too; chunks before the first span are unchanged, and no extras (or none overlapping a chunk)
give exactly the hash above. A chunk's body without extras has a fixed length, so no span can mimic it.
An engine integration that cannot key an input of a request must not cache that request at all.

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
import enum
import hashlib
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from kvtier.base.errors import ConfigError, InvalidArgument
from kvtier.base.hashes import HASH_BYTES, ChunkHash
from kvtier.base.layout import KVSpec

if TYPE_CHECKING:
    from kvtier.base.state import ModelStateSpec

_DOMAIN = b"kvtier/namespace/v1"
_SEGMENT_DOMAIN = b"kvtier/segment/v1"
_EXTRA_DOMAIN = b"kvtier/extra/v1"
_U32 = struct.Struct("<I")
_SPAN = struct.Struct("<QQ")
#: The end of a span that covers every position from its start on (an adapter).
SPAN_END = (1 << 63) - 1

Tokens = Sequence[int] | np.ndarray  # or a torch.Tensor (torch is not imported here; see token_array)


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

    def chunk_hashes(self, tokens: Tokens, extras: ExtraKeys | None = None) -> list[ChunkHash]:
        return chunk_hashes(self.root, tokens, self.chunk_size, extras)

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
    torch = sys.modules.get("torch")  # a tensor exists only if torch is loaded: the router never imports it
    if torch is not None and isinstance(tokens, torch.Tensor):
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


def chunk_hashes(root: ChunkHash, tokens: Tokens, chunk_size: int,
                 extras: ExtraKeys | None = None) -> list[ChunkHash]:
    """Chained hashes of the full chunks of ``tokens``, each with the ``extras`` overlapping it folded in (see
    module docstring)."""
    data = memoryview(token_array(tokens)).cast("B")
    step = chunk_size * 4
    n_full = len(data) // step
    folded = extras.per_chunk(chunk_size, n_full) if extras else {}
    length = _U32.pack(chunk_size)
    sha256 = hashlib.sha256
    out: list[ChunkHash] = []
    prev = bytes(root)
    for i in range(n_full):
        h = sha256(prev)
        h.update(length)
        h.update(data[i * step : (i + 1) * step])
        if i in folded:
            h.update(folded[i])
        prev = h.digest()
        out.append(ChunkHash(prev))
    return out


class InputKind(enum.Enum):
    """What kind of input a span key stands for (its value is part of the span's encoding)."""

    LORA = "lora"  #: an adapter: every position from its start on
    MULTIMODAL = "mm"  #: an image, audio or video input: its placeholder positions
    CACHE_SALT = "cache_salt"  #: a per-request salt the engine folds into the first block
    PROMPT_EMBEDS = "prompt_embeds"  #: a digest of the embedding rows of the span


@dataclass(frozen=True, slots=True)
class SpanKey:
    """One input's part of the key: folded into every chunk overlapping tokens ``[start, end)``."""

    kind: InputKind
    start: int
    end: int
    value: bytes

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= SPAN_END:
            raise InvalidArgument(f"span [{self.start}, {self.end}) of a {self.kind.value} key is empty or out of "
                                  "range")
        if not isinstance(self.value, bytes):
            raise InvalidArgument(f"a {self.kind.value} span key's value must be bytes")

    def encode(self) -> bytes:
        kind = self.kind.value.encode()
        return (_U32.pack(len(kind)) + kind + _SPAN.pack(self.start, self.end)
                + _U32.pack(len(self.value)) + self.value)


@dataclass(frozen=True)
class ExtraKeys:
    """The extra keys of one request: span keys in a fixed order (the order they are folded in).

    ``encode``/``decode`` give the bytes that carry them between processes (the same encoding the hash uses,
    behind a count); ``decode`` raises InvalidArgument for anything that is not such an encoding."""

    spans: tuple[SpanKey, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.spans)

    def kinds(self) -> set[InputKind]:
        return {s.kind for s in self.spans}

    def overlapping(self, start: int, end: int) -> list[SpanKey]:
        """The spans that overlap tokens ``[start, end)``, in order."""
        return [s for s in self.spans if s.start < end and s.end > start]

    def per_chunk(self, chunk_size: int, n_chunks: int) -> dict[int, bytes]:
        """Chunk index -> the bytes folded into its hash, for the chunks below ``n_chunks`` that any span
        overlaps. Linear in the chunks each span covers."""
        parts: dict[int, list[bytes]] = {}
        for span in self.spans:
            first, last = span.start // chunk_size, min((span.end - 1) // chunk_size, n_chunks - 1)
            encoded = span.encode()
            for i in range(first, last + 1):
                parts.setdefault(i, []).append(encoded)
        return {i: _EXTRA_DOMAIN + _U32.pack(len(p)) + b"".join(p) for i, p in parts.items()}

    def encode(self) -> bytes:
        return _U32.pack(len(self.spans)) + b"".join(s.encode() for s in self.spans)

    @classmethod
    def decode(cls, data: bytes) -> ExtraKeys:
        view, spans = memoryview(data), []
        try:
            (count,), pos = _U32.unpack_from(view, 0), _U32.size
            for _ in range(count):
                kind, pos = _read_bytes(view, pos)
                start, end = _SPAN.unpack_from(view, pos)
                value, pos = _read_bytes(view, pos + _SPAN.size)
                spans.append(SpanKey(InputKind(kind.decode()), start, end, value))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"not an encoding of extra keys: {exc}") from None
        if pos != len(view):
            raise InvalidArgument(f"{len(view) - pos} bytes after the extra keys")
        return cls(tuple(spans))

    @classmethod
    def of(cls, spans: Iterable[SpanKey]) -> ExtraKeys:
        return cls(tuple(spans))


def _read_bytes(view: memoryview, pos: int) -> tuple[bytes, int]:
    (n,) = _U32.unpack_from(view, pos)
    end = pos + _U32.size + n
    if end > len(view):
        raise ValueError("truncated")
    return bytes(view[pos + _U32.size : end]), end


NO_EXTRAS = ExtraKeys()

__all__ = ["HASH_BYTES", "NO_EXTRAS", "SPAN_END", "ChunkHash", "ExtraKeys", "InputKind", "Namespace", "SpanKey",
           "Tokens", "chunk_hashes", "token_array"]
