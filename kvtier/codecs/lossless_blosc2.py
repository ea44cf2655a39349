"""The lossless codec: an exact round trip of any dtype, smaller because KV's exponent bytes repeat.

The chunk goes through python-blosc2 as one blosc2 chunk: a byte shuffle with the element size as type
size (within each block, byte 0 of every element, then byte 1 ...: bf16's sign/exponent bytes end up
together, where zstd finds ~3 bits of information per byte, and its mantissa bytes, which are close to
random, together), then zstd level 1 per block. Blocks are 512 KiB and never split into per-byte streams:
each half of a shuffled bf16 block is then exactly two of zstd's 128 KiB blocks, so zstd keeps the
incompressible mantissa blocks raw (free to decode) and packs the exponent ones. blosc2 runs SIMD shuffles
and releases the GIL, so chunks decode in parallel on a thread pool.

Measured on SmolLM2's real bf16 KV (256-token chunks, one thread; see benchmarks/codecs.py and README):
ratio 1.45, as the hand-written byte planes it replaces (payload v1), with decode ~1.7x and encode ~1.2x
theirs. Splitting blocks into byte streams gives the same ratio and decodes slower; smaller blocks mix
exponent and mantissa bytes inside one zstd block (ratio 1.28); bit-shuffle lowers the ratio to 1.17-1.31;
zstd levels above 1 are slower and no smaller. ``lossless-lz4`` (LZ4 on split byte streams) decodes ~2x
faster at ratio 1.18; ``lossless-z<level>`` exists for measurement.

Payload v2: ``u8 version (2), u8 itemsize, u8 method (1 zstd, 2 lz4), u8 level``, then one blosc2 chunk
(none for an empty tensor). Version-1 payloads (byte planes, written by earlier kvtier) still decode, via
lossless_v1. The blosc2 chunk is untrusted: its header's sizes, type size, codec, filters and flags are
checked against the declared shape and against what this encoder writes *before* blosc2 sees it (blosc2's
decoder trusts the header's size when it writes into a buffer), and blosc2's own errors are CodecErrors.
"""

from __future__ import annotations

import struct
import threading

import blosc2
import numpy as np
import torch

from kvtier.codecs._wire import PartsPayload, PayloadReader, numel_of
from kvtier.codecs.base import check_destination
from kvtier.codecs.lossless_v1 import VERSION as _V1, decode_v1
from kvtier.errors import CodecError

_VERSION = 2
_HEAD = struct.Struct("<BBBB")
_ZSTD, _LZ4 = 1, 2
_BLOCK = 1 << 19
#: blosc2 chunk header: version, versionlz, flags, typesize, nbytes, blocksize, cbytes, filters[6],
#: udcompcode, compcode_meta, filters_meta[6], flags2, blosc2_flags (c-blosc2's blosc2.h, BLOSC2_CHUNK_*).
_CHUNK = struct.Struct("<BBBBiii6sBB6sBB")
_EXTENDED, _MEMCPYED, _DELTA = 0x05, 0x02, 0x08
#: per method: (the codec's format in bits 5-7 of the flags byte, its code in the udcompcode byte)
_FORMAT_OF = {_ZSTD: (4, blosc2.Codec.ZSTD.value), _LZ4: (1, blosc2.Codec.LZ4.value)}
_PLAIN_OR_ZERO_CHUNK = (0x00, 0x10)  # blosc2_flags: no special value, or BLOSC2_SPECIAL_ZERO << 4
_FILTERS = (0, blosc2.Filter.SHUFFLE.value)  # NOFILTER, SHUFFLE

# blosc2 holds the GIL through (de)compression unless told otherwise; the retrieve pipeline decodes chunks
# on worker threads, which only pays when it is released. Library-wide, harmless to other users.
blosc2.set_releasegil(True)


class LosslessCodec:
    """Byte shuffle + zstd (default level 1) or LZ4 via blosc2. ``decode`` returns a new tensor (never a view)."""

    codec_id = 1
    exact = True

    def __init__(self, method: int = _ZSTD, level: int = 1) -> None:
        if method not in (_ZSTD, _LZ4) or not 0 <= level <= 9:
            raise CodecError(f"lossless: bad method {method} / level {level}")
        self.method, self.level = method, level
        self.name = "lossless" if (method, level) == (_ZSTD, 1) else ("lossless-lz4" if method == _LZ4 else f"lossless-z{level}")

    @classmethod
    def variant(cls, params: str) -> LosslessCodec:
        """``lz4`` or ``z<level>`` (zstd at blosc2 level 0-9), from names like ``lossless-lz4``, ``lossless-z3``."""
        if params == "lz4":
            return cls(_LZ4, 9)
        if params.startswith("z") and params[1:].isdigit():
            return cls(_ZSTD, int(params[1:]))
        raise CodecError(f"lossless: unknown variant {params!r} (use lz4 or z<level>)")

    def _cparams(self, itemsize: int) -> dict:
        if self.method == _LZ4:  # LZ4 finds nothing across the byte streams, so each is compressed alone
            return dict(codec=blosc2.Codec.LZ4, clevel=self.level, typesize=itemsize, nthreads=1,
                        filters=[blosc2.Filter.SHUFFLE], splitmode=blosc2.SplitMode.ALWAYS_SPLIT)
        return dict(codec=blosc2.Codec.ZSTD, clevel=self.level, typesize=itemsize, nthreads=1, blocksize=_BLOCK,
                    filters=[blosc2.Filter.SHUFFLE], splitmode=blosc2.SplitMode.NEVER_SPLIT)

    def encode(self, chunk: torch.Tensor) -> PartsPayload:
        itemsize = chunk.element_size()
        head = _HEAD.pack(_VERSION, itemsize, self.method, self.level)
        if chunk.numel() == 0:
            return PartsPayload([head])
        flat = chunk.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        if flat.nbytes > blosc2.MAX_BUFFERSIZE:
            raise CodecError(f"lossless: a {flat.nbytes}-byte chunk exceeds blosc2's {blosc2.MAX_BUFFERSIZE}-byte limit")
        try:
            frame = blosc2.compress2(flat, **self._cparams(itemsize))
        except (RuntimeError, ValueError) as exc:
            raise CodecError(f"lossless: blosc2 could not compress: {exc}") from None
        return PartsPayload([head, frame])

    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        frame = self._frame(payload, shape, dtype)  # every check, before anything is allocated
        if frame is None:
            return decode_v1(payload, shape, dtype)
        out = torch.empty(shape, dtype=dtype)
        if frame.nbytes:
            _decompress(frame, out.view(-1).view(torch.uint8).numpy())
        return out

    def decode_into(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor) -> None:
        """Decompress straight into ``out`` when it is contiguous and of ``dtype``; otherwise into this thread's
        reused scratch, then one copy into ``out`` (a token range of a larger tensor: blosc2 writes whole
        chunks)."""
        check_destination(out, shape, "lossless")
        frame = self._frame(payload, shape, dtype)
        if frame is None:
            out.copy_(decode_v1(payload, shape, dtype))
        elif frame.nbytes:
            if out.is_contiguous() and out.dtype == dtype:
                _decompress(frame, out.view(-1).view(torch.uint8).numpy())
            else:
                dst = _scratch(out.numel() * dtype.itemsize)
                _decompress(frame, dst)
                out.copy_(torch.from_numpy(dst).view(dtype).view(shape))

    def _frame(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> memoryview | None:
        """The payload's blosc2 chunk, checked to decode into exactly ``shape``/``dtype`` (empty for an empty
        tensor); None for a version-1 payload (lossless_v1 checks and decodes those)."""
        numel = numel_of(shape, "lossless")
        reader = PayloadReader(payload, "lossless")
        version, itemsize, method, _level = reader.unpack(_HEAD)
        if version == _V1:
            return None
        if version != _VERSION or itemsize != dtype.itemsize or method not in _FORMAT_OF:
            raise CodecError(f"lossless payload v{version}, {itemsize}-byte items, method {method} does not fit {dtype}")
        frame = reader.take(payload.nbytes - _HEAD.size)
        if numel:
            check_blosc2_chunk(frame, numel * itemsize, itemsize, _FORMAT_OF[method])
        return frame if numel else frame[:0]


def _decompress(frame: memoryview, dst: np.ndarray) -> None:
    """Decompress a checked blosc2 chunk into ``dst`` (exactly its declared bytes)."""
    try:
        blosc2.decompress2(frame, dst=dst, nthreads=1)
    except (RuntimeError, ValueError) as exc:
        raise CodecError(f"lossless: corrupt blosc2 chunk: {exc}") from None


_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """``nbytes`` of this thread's decode scratch, grown as needed and kept: reused memory is ~10x faster to
    write here than freshly faulted pages. Holds one chunk's bytes per decoding thread."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def check_blosc2_chunk(frame: memoryview, nbytes: int, typesize: int, codec: tuple[int, int]) -> None:
    """CodecError unless ``frame`` is exactly one blosc2 chunk of ``nbytes`` bytes as this codec writes them.

    Checked: the header fits, it declares ``nbytes`` / ``typesize`` / the frame's own length, a block size
    within the data, the expected codec (its data may be a plain copy), at most a shuffle as filter, no delta,
    dictionary, lazy chunk or special value other than all-zeros. blosc2 writes ``nbytes`` bytes into the
    destination it is given without checking its length, so this must pass before it is called.
    """
    if frame.nbytes < _CHUNK.size:
        raise CodecError(f"lossless: {frame.nbytes} bytes cannot hold a blosc2 chunk header")
    (_v, _vlz, flags, size, declared, block, cbytes, filters, udcodec, _meta, filter_meta, flags2,
     b2flags) = _CHUNK.unpack_from(frame)
    if declared != nbytes or size != typesize or cbytes != frame.nbytes or not 0 < block <= nbytes:
        raise CodecError(f"lossless: blosc2 chunk of {declared} bytes ({size}-byte items, {cbytes} stored, "
                         f"{block}-byte blocks) does not fit {nbytes} bytes of {typesize}-byte items in {frame.nbytes}")
    plain = bool(flags & _MEMCPYED)
    if plain and cbytes != nbytes + _CHUNK.size:
        raise CodecError("lossless: a copied blosc2 chunk of the wrong length")
    wrong_codec = udcodec != codec[1] or not plain and flags >> 5 != codec[0]
    if flags & _EXTENDED != _EXTENDED or flags & _DELTA or wrong_codec or any(f not in _FILTERS for f in filters):
        raise CodecError(f"lossless: blosc2 chunk flags {flags:#x} / filters {bytes(filters).hex()} are not this codec's")
    if flags2 or any(filter_meta) or b2flags not in _PLAIN_OR_ZERO_CHUNK:
        raise CodecError(f"lossless: blosc2 chunk uses features this codec never writes (flags {b2flags:#x})")

