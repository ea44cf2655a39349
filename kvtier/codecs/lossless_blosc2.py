"""The second ``lossless`` payload format (blosc2), written by the ``lossless-lz4`` and ``lossless-z<level>``
variants and, before payload v3, by ``lossless`` itself: chunks stored then still load.

The chunk goes through python-blosc2 as one blosc2 chunk: a byte shuffle with the element size as type
size (within each 512 KiB block, byte 0 of every element, then byte 1 ...), then zstd at the variant's level
per block (blocks never split into per-byte streams: each half of a shuffled bf16 block is exactly two of
zstd's 128 KiB blocks, so zstd keeps the mantissa blocks raw and packs the exponent ones), or LZ4 on split
byte streams (LZ4 finds nothing across them). blosc2 runs SIMD shuffles and releases the GIL.

zstd level 1 is the default because higher levels were slower and no smaller; LZ4 trades ratio for decode
speed. Payload v3 (``lossless``) keeps the ratio and decodes faster: blosc2 does not expose the zstd
parameters that make the difference (see ``kvtier.codecs.lossless``; figures in docs/benchmarks/codecs.md).

Payload v2: ``u8 version (2), u8 itemsize, u8 method (1 zstd, 2 lz4), u8 level``, then one blosc2 chunk
(none for an empty tensor). The blosc2 chunk is untrusted: its header's sizes, type size, codec, filters and
flags are checked against the declared shape and against what this encoder writes *before* blosc2 sees it
(blosc2's decoder trusts the header's size when it writes into a buffer), and blosc2's own errors are
CodecErrors.
"""

from __future__ import annotations

import struct

import blosc2
import numpy as np
import torch

from kvtier.base.errors import CodecError
from kvtier.codecs._local import scratch
from kvtier.codecs._wire import PartsPayload, PayloadReader, numel_of

VERSION = 2
HEAD = struct.Struct("<BBBB")
ZSTD, LZ4 = 1, 2
_BLOCK = 1 << 19
#: blosc2 chunk header: version, versionlz, flags, typesize, nbytes, blocksize, cbytes, filters[6],
#: udcompcode, compcode_meta, filters_meta[6], flags2, blosc2_flags (c-blosc2's blosc2.h, BLOSC2_CHUNK_*).
_CHUNK = struct.Struct("<BBBBiii6sBB6sBB")
_EXTENDED, _MEMCPYED, _DELTA = 0x05, 0x02, 0x08
#: per method: (the codec's format in bits 5-7 of the flags byte, its code in the udcompcode byte)
_FORMAT_OF = {ZSTD: (4, blosc2.Codec.ZSTD.value), LZ4: (1, blosc2.Codec.LZ4.value)}
_PLAIN_OR_ZERO_CHUNK = (0x00, 0x10)  # blosc2_flags: no special value, or BLOSC2_SPECIAL_ZERO << 4
_FILTERS = (0, blosc2.Filter.SHUFFLE.value)  # NOFILTER, SHUFFLE

# blosc2 holds the GIL through (de)compression unless told otherwise; the retrieve pipeline decodes chunks
# on worker threads, which only pays when it is released. Library-wide, harmless to other users.
blosc2.set_releasegil(True)


def encode_v2(chunk: torch.Tensor, method: int, level: int) -> PartsPayload:
    """A v2 payload of ``chunk`` (any strides and device) with blosc2's ``method`` at ``level``."""
    itemsize = chunk.element_size()
    head = HEAD.pack(VERSION, itemsize, method, level)
    if chunk.numel() == 0:
        return PartsPayload([head])
    flat = chunk.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
    if flat.nbytes > blosc2.MAX_BUFFERSIZE:
        raise CodecError(f"lossless: a {flat.nbytes}-byte chunk exceeds blosc2's {blosc2.MAX_BUFFERSIZE}-byte limit")
    if method == LZ4:  # LZ4 finds nothing across the byte streams, so each is compressed alone
        cparams = dict(codec=blosc2.Codec.LZ4, splitmode=blosc2.SplitMode.ALWAYS_SPLIT)
    else:
        cparams = dict(codec=blosc2.Codec.ZSTD, blocksize=_BLOCK, splitmode=blosc2.SplitMode.NEVER_SPLIT)
    try:
        frame = blosc2.compress2(flat, clevel=level, typesize=itemsize, nthreads=1, filters=[blosc2.Filter.SHUFFLE],
                                 **cparams)
    except (RuntimeError, ValueError) as exc:
        raise CodecError(f"lossless: blosc2 could not compress: {exc}") from None
    return PartsPayload([head, frame])


def decode_v2_into(frame: memoryview, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor) -> None:
    """Decode a v2 payload's blosc2 chunk, as ``checked_frame`` returned it, into ``out`` (``shape``, on the
    CPU, any strides and floating dtype): straight into it when it is contiguous and of ``dtype``, otherwise
    into this thread's reused scratch, then one copy (blosc2 writes whole chunks)."""
    if not frame.nbytes:
        return
    if out.is_contiguous() and out.dtype == dtype:
        _decompress(frame, out.view(-1).view(torch.uint8).numpy())
    else:
        dst = scratch("blosc2", out.numel() * dtype.itemsize)
        _decompress(frame, dst)
        out.copy_(torch.from_numpy(dst).view(dtype).view(shape))


def checked_frame(payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> memoryview:
    """A v2 payload's blosc2 chunk, checked to decode into exactly ``shape``/``dtype`` (empty for an empty
    tensor); CodecError where it does not."""
    numel = numel_of(shape, "lossless")
    reader = PayloadReader(payload, "lossless")
    version, itemsize, method, _level = reader.unpack(HEAD)
    if version != VERSION or itemsize != dtype.itemsize or method not in _FORMAT_OF:
        raise CodecError(f"lossless payload v{version}, {itemsize}-byte items, method {method} does not fit {dtype}")
    frame = reader.take(payload.nbytes - HEAD.size)
    if numel:
        check_blosc2_chunk(frame, numel * itemsize, itemsize, _FORMAT_OF[method])
    return frame if numel else frame[:0]


def _decompress(frame: memoryview, dst: np.ndarray) -> None:
    """Decompress a checked blosc2 chunk into ``dst`` (exactly its declared bytes)."""
    try:
        blosc2.decompress2(frame, dst=dst, nthreads=1)
    except (RuntimeError, ValueError) as exc:
        raise CodecError(f"lossless: corrupt blosc2 chunk: {exc}") from None


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
        raise CodecError(f"lossless: blosc2 chunk flags {flags:#x} / filters {bytes(filters).hex()} "
                         "are not this codec's")
    if flags2 or any(filter_meta) or b2flags not in _PLAIN_OR_ZERO_CHUNK:
        raise CodecError(f"lossless: blosc2 chunk uses features this codec never writes (flags {b2flags:#x})")
