"""Decoder of the first ``lossless`` payload format (byte planes), kept so chunks stored before the move to
blosc2 still load: a disk or Redis tier written by an older kvtier keeps its hits after an upgrade.

Payload v1: ``u8 version (1), u8 itemsize, u8 method (1 zstd, 2 lz4), u8 level`` then, per byte plane
(byte ``i`` of every element), ``u8 stored_as (0 raw, 1 compressed), u64 length, bytes``. Nothing writes this
format any more; decoding is as strict as it always was: every length is checked against the declared shape
before anything is allocated, and any mismatch is a CodecError.
"""

from __future__ import annotations

import struct
import threading

import lz4.block
import numpy as np
import torch
import zstandard

from kvtier.base.errors import CodecError
from kvtier.codecs._wire import PayloadReader, numel_of

VERSION = 1
_HEAD = struct.Struct("<BBBB")
_PLANE = struct.Struct("<BQ")
_RAW, _PACKED = 0, 1
_ZSTD, _LZ4 = 1, 2
_LOCAL = threading.local()


def decode_v1(payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A v1 payload as a new tensor of ``shape``/``dtype``; CodecError when it does not fit them."""
    numel = numel_of(shape, "lossless")
    reader = PayloadReader(payload, "lossless")
    version, itemsize, method, _level = reader.unpack(_HEAD)
    if version != VERSION or itemsize != dtype.itemsize or method not in (_ZSTD, _LZ4):
        raise CodecError(f"lossless payload v{version}, {itemsize}-byte items, method {method} does not fit {dtype}")
    out = np.empty((numel, itemsize), dtype=np.uint8)
    for i in range(itemsize):
        stored_as, length = reader.unpack(_PLANE)
        data = reader.take(length)
        if stored_as == _RAW and length == numel:
            out[:, i] = np.frombuffer(data, dtype=np.uint8)
        elif stored_as == _PACKED:
            out[:, i] = np.frombuffer(_decompress(method, data, numel), dtype=np.uint8)
        else:
            raise CodecError(f"lossless plane {i}: stored as {stored_as} with {length} bytes, expected {numel}")
    reader.finish()
    if numel == 0:  # torch cannot view an empty byte array as a wider dtype
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(out).view(dtype).reshape(shape)


def _decompress(method: int, data: memoryview, numel: int) -> bytes:
    """Exactly ``numel`` bytes out of ``data``, checking the declared size before anything is allocated."""
    try:
        if method == _LZ4:
            out = lz4.block.decompress(data, uncompressed_size=numel)
        else:
            if zstandard.frame_content_size(data) != numel:
                raise CodecError("lossless: zstd frame declares another size than the shape implies")
            out = _decompressor().decompress(data, max_output_size=numel)
    except (zstandard.ZstdError, lz4.block.LZ4BlockError, ValueError) as exc:
        raise CodecError(f"lossless: corrupt compressed plane: {exc}") from None
    if len(out) != numel:
        raise CodecError(f"lossless: plane decompressed to {len(out)} bytes, expected {numel}")
    return out


def _decompressor() -> zstandard.ZstdDecompressor:
    """One per thread: a zstd context is reusable but not shareable across threads."""
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return dctx
