"""The blosc2 lossless format (payload v2): payloads written before v3 still decode bit-exactly, the
``lossless-lz4`` / ``lossless-z<level>`` variants still write it, and the blosc2 chunk header is checked
against the declared shape before blosc2 touches a byte."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.base.errors import CodecError
from kvtier.codecs import get_codec
from kvtier.codecs.lossless_blosc2 import _CHUNK
from tests.codecs.conftest import kv_like, roundtrip

V2_PAYLOADS = Path(__file__).parent / "data" / "lossless_v2_payloads.json"
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _v2_cases() -> list[dict]:
    return json.loads(V2_PAYLOADS.read_text())["cases"]


@pytest.mark.parametrize("case", _v2_cases(), ids=lambda c: f"{c['codec']}-{c['dtype']}-{len(c['payload_hex'])}")
def test_payloads_of_the_blosc2_format_still_decode(case: dict) -> None:
    """Chunks stored by kvtier before payload v3 (fixture written by that code) load bit-exactly, as new
    tensors and into a token range of a larger one."""
    dtype = getattr(torch, case["dtype"])
    shape = tuple(case["shape"])
    want = torch.frombuffer(bytearray.fromhex(case["tensor_hex"]), dtype=torch.uint8).view(dtype).reshape(shape)
    payload = memoryview(bytearray.fromhex(case["payload_hex"]))
    assert payload[0] == 2  # the blosc2 format's version byte
    bits = BITS[dtype.itemsize]
    assert torch.equal(get_codec("lossless").decode(payload, shape, dtype).view(bits), want.view(bits))
    big = torch.zeros(shape[0], shape[1], shape[2] + 3, *shape[3:], dtype=dtype)
    get_codec("lossless").decode_into(payload, shape, dtype, big[:, :, 1 : 1 + shape[2]])
    assert torch.equal(big[:, :, 1 : 1 + shape[2]].view(bits), want.view(bits))
    assert not big[:, :, :1].view(bits).any() and not big[:, :, 1 + shape[2] :].view(bits).any()
    with pytest.raises(CodecError):
        get_codec("lossless").decode(payload[:-1], shape, dtype)


@pytest.mark.parametrize("name", ["lossless-z1", "lossless-lz4"])
def test_the_blosc2_variants_still_write_it(name: str) -> None:
    chunk = kv_like(layers=2, tokens=64, heads=2, dim=64)
    out, buf = roundtrip(get_codec(name), chunk)
    assert buf[0] == 2 and torch.equal(out.view(torch.int16), chunk.view(torch.int16))


def test_an_all_zero_blosc2_chunk_is_a_header_alone() -> None:
    """blosc2 stores an all-zero chunk as a header alone (a special value): allowed, and decoded as zeros."""
    chunk = torch.zeros(2, 2, 64, 2, 64, dtype=torch.bfloat16)
    out, buf = roundtrip(get_codec("lossless-z1"), chunk)
    assert len(buf) == 4 + _CHUNK.size and torch.equal(out, chunk)


def _valid(chunk: torch.Tensor | None = None, name: str = "lossless-z1") -> tuple[bytearray, torch.Tensor]:
    chunk = kv_like(layers=2, tokens=64, heads=2, dim=64) if chunk is None else chunk
    return roundtrip(get_codec(name), chunk)[1], chunk


def _set(buf: bytearray, field: str, value: int) -> bytearray:
    """Rewrite one field of the blosc2 chunk header that follows the 4-byte codec header."""
    offsets = {"flags": (2, "B"), "typesize": (3, "B"), "nbytes": (4, "<i"), "blocksize": (8, "<i"),
               "cbytes": (12, "<i"), "filter0": (16, "B"), "filter1": (17, "B"), "udcodec": (22, "B"),
               "filter_meta": (24, "B"), "flags2": (30, "B"), "blosc2_flags": (31, "B")}
    at, fmt = offsets[field]
    struct.pack_into(fmt, buf, 4 + at, value)
    return buf


HEADER_DAMAGE = [
    ("nbytes", 1 << 30),  # would make blosc2 write far past the output tensor
    ("nbytes", 100),
    ("typesize", 4),
    ("cbytes", 1 << 20),
    ("cbytes", 40),
    ("blocksize", 0),
    ("blocksize", 1 << 30),
    ("flags", 0x85 & ~0x04),  # not an extended (blosc2) header
    ("flags", 0x95 | 0x08),  # delta filter
    ("flags", 0x35),  # LZ4 format under a zstd payload header
    ("filter0", 2),  # bit-shuffle
    ("filter1", 3),  # delta
    ("udcodec", 1),  # LZ4 code under a zstd payload header
    ("filter_meta", 7),
    ("flags2", 1),
    ("blosc2_flags", 0x40),  # special value "uninitialised": would hand out whatever memory held
    ("blosc2_flags", 0x01),  # dictionary
]


@pytest.mark.parametrize("field,value", HEADER_DAMAGE)
def test_blosc2_header_is_checked_before_decompressing(field: str, value: int) -> None:
    buf, chunk = _valid()
    with pytest.raises(CodecError):
        get_codec("lossless").decode(memoryview(_set(buf, field, value)), tuple(chunk.shape), chunk.dtype)


def test_a_frame_of_the_other_method_is_refused() -> None:
    lz4, chunk = _valid(name="lossless-lz4")
    lz4[2] = 1  # claim zstd in the payload header
    with pytest.raises(CodecError):
        get_codec("lossless").decode(memoryview(lz4), tuple(chunk.shape), chunk.dtype)


BLOSC2_HEAD = st.tuples(st.sampled_from([0x85, 0x95, 0x87, 0x97, 0x25, 0x35]), st.sampled_from([1, 2, 4]),
                        st.integers(1, 1 << 16), st.sampled_from([b"\x01" + bytes(5), bytes(6)]),
                        st.sampled_from([1, 5]), st.sampled_from([0, 0x10]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=BLOSC2_HEAD, tail=st.binary(max_size=512), tokens=st.integers(1, 9), dtype=st.sampled_from(
    [torch.bfloat16, torch.float16, torch.float32]))
def test_plausible_blosc2_chunks_decode_or_fail_cleanly(head, tail: bytes, tokens: int, dtype) -> None:
    """A header that passes every check (sizes right for the shape) over arbitrary blocks: blosc2 must then
    reject or decode them within the output, never crash or write elsewhere."""
    flags, _typesize, block, filters, udcodec, b2flags = head
    shape = (1, 2, tokens, 2, 16)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    total = _CHUNK.size + len(tail)
    chunk = _CHUNK.pack(5, 1, flags, dtype.itemsize, nbytes, min(block, nbytes), total, filters, udcodec, 0,
                        bytes(6), 0, b2flags)
    payload = struct.pack("<BBBB", 2, dtype.itemsize, 1 if udcodec == 5 else 2, 1) + chunk + tail
    try:
        out = get_codec("lossless").decode(memoryview(bytearray(payload)), shape, dtype)
    except CodecError:
        return
    assert tuple(out.shape) == shape and out.dtype == dtype
