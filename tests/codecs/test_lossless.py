"""The blosc2 lossless format: bit-exact for every stored dtype, old (v1) payloads still decode, and the
blosc2 chunk header is checked against the declared shape before blosc2 touches a byte."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.codecs import get_codec
from kvtier.codecs.lossless import _CHUNK
from kvtier.errors import CodecError
from kvtier.layout import DTYPE_CODES
from tests.codecs.conftest import kv_like, roundtrip

V1_PAYLOADS = Path(__file__).parent / "data" / "lossless_v1_payloads.json"
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _special_values(dtype: torch.dtype, shape=(2, 2, 256, 4, 128), seed: int = 0) -> torch.Tensor:
    """Every bit pattern class a float can hold, scattered over a multi-block chunk (> 512 KiB in bf16)."""
    gen = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point or dtype.itemsize == 1:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    x = torch.randn(shape, generator=gen).to(dtype)
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, info.tiny / 4, -info.tiny / 2,
                             info.max, -info.max, info.tiny]).to(dtype)
    flat = x.view(-1)
    at = torch.randint(0, flat.numel(), (4096,), generator=gen)
    flat[at] = specials[torch.arange(4096) % len(specials)]
    flat.view(BITS[dtype.itemsize])[:8] = torch.tensor([0x7FC1, 0xFFC3, 0x7F81, 1, 2, 0x8001, 0x7FFF, -1]).to(BITS[dtype.itemsize])  # payload NaNs, subnormals
    return x


@pytest.mark.parametrize("name", ["lossless", "lossless-lz4"])
@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_every_stored_dtype_is_bit_exact_across_blocks(name: str, dtype: torch.dtype) -> None:
    chunk = _special_values(dtype)
    out, _ = roundtrip(get_codec(name), chunk)
    bits = BITS[dtype.itemsize]
    assert out.dtype == dtype and torch.equal(out.view(bits), chunk.view(bits))


def test_lossless_keeps_its_ratio_on_multi_block_kv() -> None:
    chunk = kv_like(layers=2, tokens=256, heads=4, dim=128)  # 1 MiB: two blosc2 blocks
    _, buf = roundtrip(get_codec("lossless"), chunk)
    assert len(buf) < 0.8 * chunk.numel() * 2


def test_all_zero_chunk_round_trips() -> None:
    """blosc2 stores an all-zero chunk as a header alone (a special value): allowed, and decoded as zeros."""
    chunk = torch.zeros(2, 2, 64, 2, 64, dtype=torch.bfloat16)
    out, buf = roundtrip(get_codec("lossless"), chunk)
    assert len(buf) == 4 + _CHUNK.size and torch.equal(out, chunk)


def _v1_cases() -> list[dict]:
    return json.loads(V1_PAYLOADS.read_text())["cases"]


@pytest.mark.parametrize("case", _v1_cases(), ids=lambda c: f"{c['codec']}-{c['dtype']}-{len(c['payload_hex'])}")
def test_payloads_of_the_byte_plane_format_still_decode(case: dict) -> None:
    """Chunks stored by kvtier before blosc2 (payload v1, fixture written by that code) load bit-exactly."""
    dtype = getattr(torch, case["dtype"])
    shape = tuple(case["shape"])
    want = torch.frombuffer(bytearray.fromhex(case["tensor_hex"]), dtype=torch.uint8).view(dtype).reshape(shape)
    payload = memoryview(bytearray.fromhex(case["payload_hex"]))
    assert payload[0] == 1  # the old format's version byte
    out = get_codec("lossless").decode(payload, shape, dtype)
    bits = BITS[dtype.itemsize]
    assert torch.equal(out.view(bits), want.view(bits))
    with pytest.raises(CodecError):
        get_codec("lossless").decode(payload[:-1], shape, dtype)


@FUZZ
@given(case=st.sampled_from(_v1_cases()), edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                         min_size=1, max_size=4))
def test_damaged_v1_payloads_fail_cleanly(case: dict, edits) -> None:
    buf = bytearray.fromhex(case["payload_hex"])
    for at, value in edits:
        buf[at % len(buf)] = value
    dtype, shape = getattr(torch, case["dtype"]), tuple(case["shape"])
    try:
        out = get_codec("lossless").decode(memoryview(buf), shape, dtype)
    except CodecError:
        return
    assert tuple(out.shape) == shape and out.dtype == dtype


def _valid(chunk: torch.Tensor | None = None, name: str = "lossless") -> tuple[bytearray, torch.Tensor]:
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
