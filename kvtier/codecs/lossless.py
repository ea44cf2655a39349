"""The lossless codec: an exact round trip of any dtype, smaller because KV's exponent bytes repeat.

A chunk is split into byte planes (``kvtier.codecs._planes``: byte 0 of every element, then byte 1 ...). For
bf16 KV, plane 1 (sign and exponent) holds ~3 bits of information per byte and plane 0 (mantissa) is close
to random. Each plane is compressed by zstd (python-zstandard) with its matching cut down to almost nothing
(7-byte minimum matches found through a 64-entry hash table), which leaves zstd's Huffman coding of the
literals: that is where a plane's ratio comes from, and a Huffman-coded block decodes about twice as fast as
one full of short matches. A plane that does not shrink by 1/32 is stored as it is. Decoding unpacks the
compressed planes into a reused per-thread scratch and joins them with the stored ones straight into the
destination, which may be a token range of a larger tensor. It packs as tightly as the blosc2 format it
replaces (payload v2: byte shuffle + zstd level 1 with zstd's default matching) and decodes faster
(benchmarks/codecs.py; figures in docs/benchmarks/codecs.md).

Payload v3: ``u8 version (3), u8 itemsize, u8 method (1: zstd planes), u8 0``, then per plane ``u8 stored_as
(0 raw, 1 zstd frame), u64 length, bytes`` (no planes for an empty tensor). Everything is checked before any
byte is decoded: a raw plane's length is the element count; a zstd plane must be exactly one frame of that
length (its blocks are walked), declaring that content size, no dictionary and a window of at most 1 MiB
(this encoder writes 128 KiB); zstd's own errors are CodecErrors. Version-2 payloads (blosc2) and version-1
payloads (numpy byte planes) still decode, and ``lossless-lz4`` / ``lossless-z<level>`` still write v2.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import zstandard

from kvtier.base.errors import CodecError
from kvtier.codecs import _planes
from kvtier.codecs._local import inflate_into, local, scratch
from kvtier.codecs._wire import PartsPayload, PayloadReader, numel_of
from kvtier.codecs.base import check_destination
from kvtier.codecs.lossless_blosc2 import LZ4, ZSTD, checked_frame, decode_v2_into, encode_v2
from kvtier.codecs.lossless_blosc2 import VERSION as _V2
from kvtier.codecs.lossless_v1 import VERSION as _V1
from kvtier.codecs.lossless_v1 import decode_v1

_VERSION = 3
_HEAD = struct.Struct("<BBBB")
_PLANES = 1  # method: zstd on byte planes
_PLANE = struct.Struct("<BQ")
_RAW, _ZSTD_FRAME = 0, 1
#: zstd parameters of the planes: 128 KiB window, matches of 7+ bytes from a 64-entry hash table
_PARAMS = dict(window_log=17, chain_log=6, hash_log=6, search_log=1, min_match=7, target_length=0,
               strategy=zstandard.STRATEGY_FAST)
_MAX_WINDOW = 1 << 20
_MIN_GAIN = 32  # a plane is stored compressed only if that saves 1/32 of it
_RLE_BLOCK = 1  # zstd block type 1 (RLE): a body of one byte, whatever the size it stands for


class LosslessCodec:
    """Byte planes + zstd (payload v3), or the blosc2 variants (payload v2). ``decode`` returns a new tensor."""

    codec_id = 1
    exact = True

    def __init__(self, method: int | None = None, level: int = 1) -> None:
        """``method`` None: byte planes + zstd; ``ZSTD``/``LZ4`` (at blosc2 ``level`` 0-9): the v2 variants."""
        if method not in (None, ZSTD, LZ4) or not 0 <= level <= 9:
            raise CodecError(f"lossless: bad method {method} / level {level}")
        self.method, self.level = method, level
        self.name = ("lossless" if method is None else "lossless-lz4" if method == LZ4 else f"lossless-z{level}")

    @classmethod
    def variant(cls, params: str) -> LosslessCodec:
        """``lz4`` or ``z<level>`` (blosc2 with zstd at level 0-9), from names like ``lossless-lz4``,
        ``lossless-z3``."""
        if params == "lz4":
            return cls(LZ4, 9)
        if params.startswith("z") and params[1:].isdigit():
            return cls(ZSTD, int(params[1:]))
        raise CodecError(f"lossless: unknown variant {params!r} (use lz4 or z<level>)")

    def encode(self, chunk: torch.Tensor) -> PartsPayload:
        if self.method is not None:
            return encode_v2(chunk, self.method, self.level)
        itemsize, numel = chunk.element_size(), chunk.numel()
        parts: list = [_HEAD.pack(_VERSION, itemsize, _PLANES, 0)]
        if numel == 0:
            return PartsPayload(parts)
        planes = scratch("lossless_split", itemsize * numel).reshape(itemsize, numel)
        _planes.split(chunk.detach().to("cpu"), planes)
        compressor = local("lossless_compressor", lambda: zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(**_PARAMS)))
        for plane in planes:
            packed = compressor.compress(plane)
            if len(packed) <= numel - numel // _MIN_GAIN:
                parts += [_PLANE.pack(_ZSTD_FRAME, len(packed)), packed]
            else:
                parts += [_PLANE.pack(_RAW, numel), plane.copy()]  # the scratch is this thread's next split
        return PartsPayload(parts)

    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if _version(payload) == _V1:
            return decode_v1(payload, shape, dtype)
        checked = _checked(payload, shape, dtype)  # before anything is allocated
        out = torch.empty(shape, dtype=dtype)
        _decode_checked(checked, shape, dtype, out)
        return out

    def decode_into(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor) -> None:
        """Decode into ``out`` (``shape``, on the CPU, any strides: a token range of a larger tensor). v3 joins
        the planes straight into it (through a scratch tensor only where ``out`` has another dtype)."""
        check_destination(out, shape, "lossless")
        if _version(payload) == _V1:
            out.copy_(decode_v1(payload, shape, dtype))
        else:
            _decode_checked(_checked(payload, shape, dtype), shape, dtype, out)


def _checked(payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> memoryview | list:
    """A v2 payload's checked blosc2 chunk, or a v3 payload's checked planes."""
    return checked_frame(payload, shape, dtype) if _version(payload) == _V2 else _checked_planes(payload, shape, dtype)


def _decode_checked(checked: memoryview | list, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor) -> None:
    if isinstance(checked, memoryview):
        decode_v2_into(checked, shape, dtype, out)
    elif checked:
        target = out
        if out.dtype != dtype:
            target = torch.from_numpy(scratch("lossless_cast", out.numel() * dtype.itemsize)).view(dtype).view(shape)
        _planes.join(target, _unpack(checked, out.numel()))
        if target is not out:
            out.copy_(target)


def _version(payload: memoryview) -> int:
    if payload.nbytes < 1:
        raise CodecError("lossless payload is empty")
    return (payload if payload.format == "B" else payload.cast("B"))[0]


def _checked_planes(payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, memoryview]]:
    """The payload's ``(stored_as, bytes)`` per plane, every length and frame checked against ``shape`` /
    ``dtype`` (empty for an empty tensor)."""
    numel = numel_of(shape, "lossless")
    reader = PayloadReader(payload, "lossless")
    version, itemsize, method, _ = reader.unpack(_HEAD)
    if version != _VERSION or itemsize != dtype.itemsize or method != _PLANES:
        raise CodecError(f"lossless payload v{version}, {itemsize}-byte items, method {method} does not fit {dtype}")
    planes = []
    for _ in range(itemsize if numel else 0):
        stored_as, length = reader.unpack(_PLANE)
        data = reader.take(length)
        if stored_as == _RAW and length != numel:
            raise CodecError(f"lossless: a raw plane of {length} bytes for {numel} elements")
        if stored_as == _ZSTD_FRAME:
            _check_frame(data, numel)
        elif stored_as != _RAW:
            raise CodecError(f"lossless: plane stored as {stored_as}, which this codec never writes")
        planes.append((stored_as, data))
    reader.finish()
    return planes


def _check_frame(frame: memoryview, numel: int) -> None:
    """CodecError unless ``frame`` is exactly one zstd frame of ``numel`` bytes as this codec writes them."""
    try:
        params = zstandard.get_frame_parameters(frame)
        at = zstandard.frame_header_size(frame)
    except zstandard.ZstdError as exc:
        raise CodecError(f"lossless: not a zstd frame: {exc}") from None
    if params.content_size != numel or params.dict_id or params.window_size > _MAX_WINDOW:
        raise CodecError(f"lossless: zstd frame of {params.content_size} bytes (window {params.window_size}, "
                         f"dictionary {params.dict_id}) does not fit a plane of {numel}")
    last = 0
    while not last:  # the frame's blocks: 3-byte headers (last flag, type, size), bodies
        if at + 3 > frame.nbytes:
            raise CodecError("lossless: zstd frame truncated")
        header = int.from_bytes(frame[at : at + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise CodecError("lossless: zstd block of the reserved type")
        at += 3 + (1 if kind == _RLE_BLOCK else size)
    at += 4 if params.has_checksum else 0
    if at != frame.nbytes:
        raise CodecError(f"lossless: a zstd frame of {at} bytes in a plane of {frame.nbytes}")


def _unpack(planes: list[tuple[int, memoryview]], numel: int) -> list[np.ndarray]:
    """Each checked plane's ``numel`` bytes: stored ones viewed in place, zstd frames decompressed into rows
    of this thread's scratch (for bf16 KV, half a chunk)."""
    packed = sum(stored_as == _ZSTD_FRAME for stored_as, _ in planes)
    rows = iter(scratch("lossless_planes", numel * packed).reshape(packed, numel))
    decompressor = local("lossless_decompressor", lambda: zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW))
    out = []
    for stored_as, data in planes:
        if stored_as == _RAW:
            out.append(np.frombuffer(data, dtype=np.uint8))
        else:
            out.append(inflate_into(decompressor, data, next(rows), "lossless"))
    return out
