"""Decoders on untrusted bytes: random payloads and mutated valid ones raise CodecError or decode to a
tensor of exactly the declared shape and dtype; nothing else (no crash, no other exception, no over-allocation)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.base.errors import CodecError
from kvtier.codecs import codec_by_id, get_codec
from kvtier.codecs.base import decode_into
from tests.codecs.conftest import kv_like, roundtrip

NAMES = ["raw", "lossless", "lossless-lz4", "int8", "int4", "int4-g32", "cachegen"]
SHAPES = st.tuples(st.integers(1, 3), st.just(2), st.integers(0, 9), st.integers(1, 3), st.sampled_from([2, 8, 16, 64]))
DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_codec_error(codec, data: bytes, shape, dtype) -> None:
    """``decode`` raises CodecError or returns the declared shape and dtype; ``decode_into`` a token range of
    a larger tensor gives the same verdict, the same bits, and leaves the rest of that tensor alone."""
    try:
        out = codec.decode(memoryview(bytearray(data)), tuple(shape), dtype)
    except CodecError:
        out = None
    else:
        assert tuple(out.shape) == tuple(shape) and out.dtype == dtype
    wide = torch.zeros(shape[0], 2, shape[2] + 2, *shape[3:], dtype=dtype)
    try:
        decode_into(codec, memoryview(bytearray(data)), tuple(shape), dtype, wide[:, :, 1 : 1 + shape[2]])
    except CodecError:
        assert out is None, "decode_into refused what decode accepted"
        return
    assert out is not None, "decode_into accepted what decode refused"
    as_bytes = lambda t: t.contiguous().view(-1).view(torch.uint8)  # noqa: E731  (NaNs compare by their bits)
    assert torch.equal(as_bytes(wide[:, :, 1 : 1 + shape[2]]), as_bytes(out))
    assert not wide[:, :, 0].any() and not wide[:, :, -1].any()


@pytest.mark.parametrize("codec_id", [0, 1, 2, 3, 4])
@FUZZ
@given(data=st.binary(max_size=2048), shape=SHAPES, dtype=DTYPES)
def test_random_bytes(codec_id: int, data: bytes, shape, dtype) -> None:
    _decode_or_codec_error(codec_by_id(codec_id), data, shape, dtype)


@pytest.mark.parametrize("codec_id", [1, 2, 3, 4])
@FUZZ
@given(tail=st.binary(max_size=64), shape=SHAPES, dtype=DTYPES, version=st.integers(0, 255))
def test_plausible_headers(codec_id: int, tail: bytes, shape, dtype, version: int) -> None:
    """Headers that get past the first checks (right version byte, sizes for the shape) still fail cleanly."""
    head = bytes([1, version % 4 + 1, 64, 0, 1, 0]) if codec_id > 1 else bytes([1, 2, 1, 1])
    _decode_or_codec_error(codec_by_id(codec_id), head + tail, shape, dtype)


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 10**6)))
def test_mutated_valid_payloads(name: str, edits, cut) -> None:
    codec = get_codec(name)
    chunk = kv_like(layers=2, tokens=6, heads=2, dim=16)
    _, buf = roundtrip(codec, chunk)
    for at, value in edits:
        buf[at % len(buf)] = value
    if cut is not None:
        del buf[cut % len(buf):]
    _decode_or_codec_error(codec, bytes(buf), chunk.shape, chunk.dtype)


@pytest.mark.parametrize("name", ["lossless", "int8", "int4", "cachegen"])
def test_huge_declared_shape_is_rejected_before_allocating(name: str) -> None:
    codec = get_codec(name)
    _, buf = roundtrip(codec, kv_like(layers=1, tokens=2))
    with pytest.raises(CodecError):
        codec.decode(memoryview(buf), (4096, 2, 1 << 20, 64, 128), torch.bfloat16)
