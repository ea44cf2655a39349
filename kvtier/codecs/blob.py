"""The stored form of one chunk: a self-describing, checksummed header followed by the codec's payload.

Layout (little-endian)::

    0   4s   magic b"KVTB"
    4   u16  format version (1)
    6   u16  codec id
    8   u8   dtype code (layout.DTYPE_CODES) of the decoded tensor
    9   u8   ndim of the decoded tensor (1..8)
    10  u8   flags (bit 0: sealed, i.e. the checksum is set)
    11  u8   reserved, 0
    12  u32  n_tokens
    16  u64  payload length in bytes
    24  16s  checksum: XXH3-128 over key || bytes 0..23 || bytes 40..end (header rest and payload)
    40  u32 * ndim      decoded shape
    ..  u32 * n_tokens  the chunk's token ids
    ..  zero padding to a multiple of 64 bytes, then the payload

Decoding treats its input as untrusted: it never crashes on any byte string, allocates nothing but small
header fields, and raises BlobError for every mismatch (truncation, bad magic, unknown version or codec,
lengths that disagree, wrong tokens, wrong key or payload via the checksum). Callers turn BlobError into a miss.

Sealing is for bytes that leave the process (disk, network). The memory tier, which never shares its buffer,
stores unsealed blobs and reads them with ``verify=False``; the header is still parsed and tokens still checked.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvtier.base.errors import BlobError
from kvtier.base.keys import ChunkHash
from kvtier.base.layout import DTYPE_CODES, DTYPES_BY_CODE
from kvtier.codecs import Codec, Payload, codec_by_id
from kvtier.codecs.base import decode_into
from kvtier.native import gpu
from kvtier.native.bulkcopy import copy_visiting

MAGIC = b"KVTB"
VERSION = 1
FLAG_SEALED = 1
MAX_NDIM = 8
MAX_TOKENS = 1 << 20
MAX_DECODED_BYTES = 1 << 34  # 16 GiB: no chunk is larger; caps what a decoder may allocate
ALIGN = 64

_FIXED = struct.Struct("<4sHHBBBBIQ16s")
_CHECKSUM_AT = 24
_CHECKSUM_END = 40
assert _FIXED.size == _CHECKSUM_END
CHECKSUM_MISMATCH = "checksum mismatch (corrupt, or stored under another key)"


def header_length(ndim: int, n_tokens: int) -> int:
    raw = _FIXED.size + 4 * ndim + 4 * n_tokens
    return (raw + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class BlobHeader:
    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    n_tokens: int
    payload_len: int
    sealed: bool

    @property
    def header_len(self) -> int:
        return header_length(len(self.shape), self.n_tokens)

    def tokens(self, blob: memoryview) -> np.ndarray:
        """The token ids stored in ``blob`` (the blob this header was parsed from), as a view."""
        at = _FIXED.size + 4 * len(self.shape)
        return np.frombuffer(blob[at : at + 4 * self.n_tokens], dtype="<u4")


#: bytes hashed per call into xxhash, which holds the GIL while it hashes: between pieces the other threads (a
#: transfer's worker handing back its result, the next window's read) get their turn, not after a whole chunk
_HASH_PIECE = 4 << 20


def _checksum(key: bytes, blob: memoryview) -> bytes:
    h = xxhash.xxh3_128(key)
    h.update(blob[:_CHECKSUM_AT])
    for at in range(_CHECKSUM_END, len(blob), _HASH_PIECE):
        h.update(blob[at : at + _HASH_PIECE])
    return h.digest()


def _header_hash(key: bytes, blob: memoryview, header_len: int) -> xxhash.xxh3_128:
    """The checksum's hash over all but the payload: fed the payload's bytes in order, its digest is
    ``_checksum(key, blob)`` (a streaming hash does not depend on where its input is cut)."""
    h = xxhash.xxh3_128(key)
    h.update(blob[:_CHECKSUM_AT])
    h.update(blob[_CHECKSUM_END:header_len])
    return h


class BlobPayload:
    """A whole blob as a Payload: header, then the codec payload, sealed in place once written."""

    __slots__ = ("_key", "_tokens", "_codec_id", "_dtype", "_shape", "_payload", "_seal", "_header_len")

    def __init__(
        self,
        key: ChunkHash,
        tokens: np.ndarray,
        codec_id: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        payload: Payload,
        seal: bool,
    ) -> None:
        if not 1 <= len(shape) <= MAX_NDIM or len(tokens) > MAX_TOKENS:
            raise BlobError(f"cannot encode a blob of shape {shape} with {len(tokens)} tokens")
        self._key, self._tokens, self._codec_id = key, np.ascontiguousarray(tokens, dtype="<u4"), codec_id
        self._dtype, self._shape, self._payload, self._seal = dtype, tuple(shape), payload, seal
        self._header_len = header_length(len(shape), len(tokens))

    @property
    def nbytes(self) -> int:
        return self._header_len + self._payload.nbytes

    def write_into(self, out: memoryview) -> None:
        """The blob into ``out``. Sealing a payload that can hash its bytes as it writes them
        (``write_visiting``: raw's copy) reads them once, not a second time out of ``out``."""
        hl = self._header_len
        plen = self._payload.nbytes
        self._write_header(out)
        write_visiting = getattr(self._payload, "write_visiting", None) if self._seal else None
        if write_visiting is not None:
            h = _header_hash(self._key, out, hl)
            if write_visiting(out[hl : hl + plen], h.update):
                out[_CHECKSUM_AT:_CHECKSUM_END] = h.digest()
                return
        self._payload.write_into(out[hl : hl + plen])
        if self._seal:
            out[_CHECKSUM_AT:_CHECKSUM_END] = _checksum(self._key, out[: hl + plen])

    def deferred_copies(self, out: memoryview) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The header now, the codec payload's bulk copies for later (see ``Payload``). A sealed blob is written
        whole: its checksum covers the payload."""
        defer = getattr(self._payload, "deferred_copies", None)
        if self._seal or defer is None:
            self.write_into(out)
            return []
        self._write_header(out)
        return defer(out[self._header_len : self._header_len + self._payload.nbytes])

    def _write_header(self, out: memoryview) -> None:
        hl = self._header_len
        plen = self._payload.nbytes
        flags = FLAG_SEALED if self._seal else 0
        fixed = _FIXED.pack(
            MAGIC, VERSION, self._codec_id, DTYPE_CODES[self._dtype], len(self._shape), flags, 0,
            len(self._tokens), plen, bytes(16),
        )
        shape = struct.pack(f"<{len(self._shape)}I", *self._shape)
        tokens = self._tokens.tobytes()
        head = fixed + shape + tokens
        out[: len(head)] = head
        out[len(head) : hl] = bytes(hl - len(head))


def encode_blob(
    key: ChunkHash, tokens: np.ndarray, codec: Codec, chunk: torch.Tensor, *, seal: bool = True
) -> BlobPayload:
    """The blob for ``chunk`` (canonical layout) under ``key``; written lazily via ``write_into``. A chunk on a
    GPU is copied to the host first unless the codec takes it as it is (``device_chunks``)."""
    if gpu.on_gpu(chunk) and not getattr(codec, "device_chunks", False):
        chunk = gpu.host_copy(chunk)
    return BlobPayload(key, tokens, codec.codec_id, chunk.dtype, tuple(chunk.shape), codec.encode(chunk), seal)


def blob_bytes(blob: Payload) -> bytearray:
    """Materialise a payload as a new bytearray (for tiers that need one object per value)."""
    out = bytearray(blob.nbytes)
    blob.write_into(memoryview(out))
    return out


def parse_blob(
    data: bytes | bytearray | memoryview,
    key: ChunkHash,
    tokens: np.ndarray | None = None,
    *,
    verify: bool = True,
) -> tuple[BlobHeader, memoryview]:
    """Check ``data`` against ``key`` (and ``tokens`` when given) and return its header and payload view.

    With ``verify`` the blob must be sealed and its checksum must match. Raises BlobError on any mismatch.
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    header, checksum = _parse(view, tokens, sealed_only=verify)
    if verify and _checksum(key, view) != checksum:
        raise BlobError(CHECKSUM_MISMATCH)
    return header, view[header.header_len :]


def _parse(view: memoryview, tokens: np.ndarray | None, *, sealed_only: bool) -> tuple[BlobHeader, bytes]:
    """``view``'s header, checked (tokens too when given; with ``sealed_only`` it must be sealed), and the
    checksum it records, not yet checked. BlobError on any mismatch."""
    if view.nbytes < _FIXED.size:
        raise BlobError(f"blob truncated: {view.nbytes} bytes")
    magic, version, codec_id, dtype_code, ndim, flags, _reserved, n_tokens, plen, checksum = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise BlobError("not a kvtier blob (bad magic)")
    if version != VERSION:
        raise BlobError(f"unsupported blob format version {version}")
    dtype = DTYPES_BY_CODE.get(dtype_code)
    if dtype is None:
        raise BlobError(f"unknown dtype code {dtype_code}")
    if not 1 <= ndim <= MAX_NDIM or n_tokens > MAX_TOKENS:
        raise BlobError(f"implausible header: ndim={ndim} n_tokens={n_tokens}")
    hl = header_length(ndim, n_tokens)
    if view.nbytes < hl or plen != view.nbytes - hl:
        raise BlobError(f"blob length {view.nbytes} disagrees with header ({hl} + {plen})")
    shape = struct.unpack_from(f"<{ndim}I", view, _FIXED.size)
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * dtype.itemsize > MAX_DECODED_BYTES:
        raise BlobError(f"declared shape {shape} exceeds the {MAX_DECODED_BYTES}-byte cap")
    if tokens is not None:
        at = _FIXED.size + 4 * ndim
        if len(tokens) != n_tokens or bytes(view[at : at + 4 * n_tokens]) != tokens.tobytes():
            raise BlobError("blob holds other tokens")
    sealed = bool(flags & FLAG_SEALED)
    if sealed_only and not sealed:
        raise BlobError("blob is not sealed")
    codec_by_id(codec_id)  # an unknown codec is a miss, not a crash later
    return BlobHeader(codec_id, dtype, tuple(shape), n_tokens, plen, sealed), checksum


def decode_blob(
    data: bytes | bytearray | memoryview,
    key: ChunkHash,
    tokens: np.ndarray | None = None,
    *,
    codec: Codec | None = None,
    verify: bool = True,
    out: torch.Tensor | None = None,
    expect: tuple[tuple[int, ...], torch.dtype] | None = None,
    write_early: bool = False,
) -> torch.Tensor:
    """Parse, check and decode a blob into its canonical tensor (possibly a view of ``data``).

    ``codec``, when given, is the only codec family accepted: a blob written with another is a BlobError. A
    variant of the same family (``int4-g32`` read by an ``int4`` tier) is accepted: its payload carries its
    parameters, and the family's codec (the one registered under the id) decodes it.

    With ``out`` (a CPU tensor of the chunk's shape, any strides) the chunk is decoded into it and ``out`` is
    returned. ``out`` is written only after the header, tokens and checksum have passed; a payload the codec
    then rejects (BlobError) may leave part of a chunk there. With ``write_early`` as well, a payload that is
    only copied (raw) is checksummed while it is copied into ``out`` (each piece hashed just before it is
    copied, so its bytes are read from memory once): the chunk is still returned only once its checksum
    matched, but a blob that fails it (BlobError) leaves its bytes in ``out``. ``expect``, when given, is the
    only ``(shape, dtype)`` accepted: a blob that decodes to anything else is a BlobError before a byte is
    decoded.
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    header, checksum = _parse(view, tokens, sealed_only=verify)
    if expect is not None and (header.shape, header.dtype) != (tuple(expect[0]), expect[1]):
        raise BlobError(f"blob holds {header.shape} {header.dtype}, expected {tuple(expect[0])} {expect[1]}")
    found = codec_by_id(header.codec_id)
    if codec is not None and header.codec_id != codec.codec_id:
        raise BlobError(f"blob was written with codec {found.name!r}, expected {codec.name!r}")
    payload = view[header.header_len :]
    if verify and out is not None and write_early and _copy_verifying(found, key, view, header, checksum, out):
        return out
    if verify and _checksum(key, view) != checksum:
        raise BlobError(CHECKSUM_MISMATCH)
    if out is None:
        return found.decode(payload, header.shape, header.dtype)
    decode_into(found, payload, header.shape, header.dtype, out)
    return out


def _copy_verifying(codec: Codec, key: ChunkHash, view: memoryview, header: BlobHeader, checksum: bytes,
                    out: torch.Tensor) -> bool:
    """For a codec whose payload is the chunk's bytes (raw): copy it into ``out`` while hashing it, then check
    the checksum (BlobError on a mismatch, ``out`` written). False, nothing written or hashed, for other codecs
    and where the copy cannot hash as it goes (``bulkcopy.copy_visiting``): the caller verifies, then decodes."""
    if not getattr(codec, "copies_only", False) or tuple(out.shape) != header.shape or out.device.type != "cpu":
        return False
    chunk = codec.decode(view[header.header_len :], header.shape, header.dtype)  # a view of the payload
    h = _header_hash(key, view, header.header_len)
    if not copy_visiting(out, chunk, h.update):
        return False
    if h.digest() != checksum:
        raise BlobError(CHECKSUM_MISMATCH)
    return True
