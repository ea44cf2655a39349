"""The lossless codec: an exact round trip of any dtype, smaller because KV's exponent bytes repeat.

Each element's bytes are split into byte planes (for bf16/fp16: the low byte, mostly mantissa, and the
high byte, sign and exponent). The high plane of real KV holds about 3 bits of information per byte and
compresses ~2.7x; mantissa planes are close to random, so each plane is stored compressed only when that
saves at least 3 %, else raw (free to decode). Measured on SmolLM2 KV (see benchmarks/codecs.py): zstd
level 1 gives the best ratio *and* speed of the zstd levels; lz4 decodes faster but compresses the exponent
plane far less (ratio ~1.18 vs ~1.45), so zstd-1 is the default and ``lossless-lz4`` / ``lossless-z<level>``
exist for measurement.

Payload: ``u8 version, u8 itemsize, u8 method, u8 level`` then per plane ``u8 stored_as, u64 length, bytes``.
"""

from __future__ import annotations

import struct
import threading

import lz4.block
import numpy as np
import torch
import zstandard

from kvtier.codecs._wire import PartsPayload, PayloadReader, numel_of
from kvtier.errors import CodecError

_VERSION = 1
_HEAD = struct.Struct("<BBBB")
_PLANE = struct.Struct("<BQ")
_RAW, _PACKED = 0, 1
_ZSTD, _LZ4 = 1, 2
_MIN_SAVING = 0.97
_LOCAL = threading.local()


class LosslessCodec:
    """Byte planes + zstd (default level 1) or lz4. Decodes into a new tensor (never a view of the payload)."""

    codec_id = 1

    def __init__(self, method: int = _ZSTD, level: int = 1) -> None:
        if method not in (_ZSTD, _LZ4) or not -7 <= level <= 22:
            raise CodecError(f"lossless: bad method {method} / level {level}")
        self.method, self.level = method, level
        self.name = "lossless" if (method, level) == (_ZSTD, 1) else ("lossless-lz4" if method == _LZ4 else f"lossless-z{level}")

    @classmethod
    def variant(cls, params: str) -> LosslessCodec:
        """``lz4`` or ``z<level>`` (zstd at that level), from names like ``lossless-lz4``, ``lossless-z3``."""
        if params == "lz4":
            return cls(_LZ4, 0)
        if params.startswith("z") and params[1:].lstrip("-").isdigit():
            return cls(_ZSTD, int(params[1:]))
        raise CodecError(f"lossless: unknown variant {params!r} (use lz4 or z<level>)")

    def _compress(self, plane: np.ndarray) -> bytes:
        if self.method == _LZ4:
            return lz4.block.compress(plane, store_size=False)
        return zstandard.ZstdCompressor(level=self.level).compress(plane)

    def encode(self, chunk: torch.Tensor) -> PartsPayload:
        itemsize = chunk.element_size()
        flat = chunk.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().reshape(-1, itemsize)
        parts: list[bytes | np.ndarray] = [_HEAD.pack(_VERSION, itemsize, self.method, self.level & 0xFF)]
        for i in range(itemsize):
            plane = np.ascontiguousarray(flat[:, i])
            packed = self._compress(plane) if plane.size else b""
            if plane.size and len(packed) <= _MIN_SAVING * plane.size:
                parts += [_PLANE.pack(_PACKED, len(packed)), packed]
            else:
                parts += [_PLANE.pack(_RAW, plane.size), plane]
        return PartsPayload(parts)

    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = numel_of(shape, "lossless")
        reader = PayloadReader(payload, "lossless")
        version, itemsize, method, _level = reader.unpack(_HEAD)
        if version != _VERSION or itemsize != dtype.itemsize or method not in (_ZSTD, _LZ4):
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


def _decompressor() -> zstandard.ZstdDecompressor:
    """One per thread: a zstd context is reusable but not shareable across threads."""
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return dctx


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
