"""The lossless codec's byte planes + zstd format (payload v3): bit-exact for every stored dtype, with or
without the native plane kernels, every plane and zstd frame checked against the declared shape before a byte
is decoded, and old byte-plane (v1) payloads still decode. The blosc2 format (v2): test_lossless_blosc2.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.base.errors import CodecError
from kvtier.base.layout import DTYPE_CODES
from kvtier.codecs import _planes, get_codec
from kvtier.codecs.lossless import _HEAD, _PLANE
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
    special = torch.tensor([0x7FC1, 0xFFC3, 0x7F81, 1, 2, 0x8001, 0x7FFF, -1])  # payload NaNs, subnormals
    flat.view(BITS[dtype.itemsize])[:8] = special.to(BITS[dtype.itemsize])
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


def test_all_zero_and_empty_chunks_round_trip() -> None:
    chunk = torch.zeros(2, 2, 64, 2, 64, dtype=torch.bfloat16)
    out, buf = roundtrip(get_codec("lossless"), chunk)
    assert len(buf) < 100 and torch.equal(out, chunk)  # both planes compress to almost nothing
    empty = torch.zeros(2, 2, 0, 2, 64, dtype=torch.bfloat16)
    out, buf = roundtrip(get_codec("lossless"), empty)
    assert len(buf) == _HEAD.size and out.shape == empty.shape


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




def _planes_of(buf: bytearray) -> list[tuple[int, int, int]]:
    """(offset of the plane record, stored_as, length) per plane of a v3 payload."""
    at, planes = _HEAD.size, []
    while at < len(buf):
        stored_as, length = _PLANE.unpack_from(buf, at)
        planes.append((at, stored_as, length))
        at += _PLANE.size + length
    return planes


def test_the_exponent_plane_is_compressed_and_the_mantissa_plane_stored() -> None:
    chunk = kv_like(layers=2, tokens=256, heads=4, dim=128)
    _, buf = roundtrip(get_codec("lossless"), chunk)
    assert buf[0] == 3
    (_, low, low_len), (_, high, high_len) = _planes_of(buf)
    assert (low, high) == (0, 1) and low_len == chunk.numel() and high_len < chunk.numel() // 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e5m2])
def test_decodes_into_a_token_range_with_and_without_the_plane_kernel(monkeypatch, dtype: torch.dtype) -> None:
    """The native kernel and torch's fallback write the same bytes, only inside the destination; a
    destination of another dtype gets the values converted."""
    chunk = _special_values(dtype, shape=(3, 2, 40, 3, 64), seed=1)
    codec = get_codec("lossless")
    _, buf = roundtrip(codec, chunk)
    bits = BITS[dtype.itemsize]
    results = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(_planes, "_kernels", lambda: None)
        assert roundtrip(codec, chunk)[1] == buf  # the same payload either way
        big = torch.zeros(3, 2, 47, 3, 64, dtype=dtype)
        codec.decode_into(memoryview(buf), tuple(chunk.shape), dtype, big[:, :, 5:45])
        assert torch.equal(big[:, :, 5:45].view(bits), chunk.view(bits))
        assert not big[:, :, :5].view(bits).any() and not big[:, :, 45:].view(bits).any()
        results.append(big)
    assert torch.equal(results[0].view(bits), results[1].view(bits))
    if dtype.itemsize > 1:
        wide = torch.zeros(3, 2, 40, 3, 64, dtype=torch.float64)
        codec.decode_into(memoryview(buf), tuple(chunk.shape), dtype, wide)
        torch.testing.assert_close(wide, chunk.to(torch.float64), rtol=0, atol=0, equal_nan=True)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), dims=st.tuples(
    st.integers(1, 3), st.integers(1, 70), st.integers(1, 3), st.integers(1, 40)), lo=st.integers(0, 5),
    hi=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_planes_split_and_join_any_token_range(dtype, dims, lo: int, hi: int, seed: int) -> None:
    """Byte planes of strided views (odd run lengths, unaligned starts) against numpy's, and back."""
    layers, tokens, heads, dim = dims
    gen = torch.Generator().manual_seed(seed)
    bits = BITS[dtype.itemsize]
    big = torch.randint(-(2**15), 2**15, (layers, 2, lo + tokens + hi, heads, dim), generator=gen).to(bits).view(dtype)
    view = big[:, :, lo : lo + tokens]
    k = dtype.itemsize
    planes = np.empty((k, view.numel()), np.uint8)
    _planes.split(view, planes)
    want = view.contiguous().view(-1).view(torch.uint8).view(-1, k).t().numpy()
    assert (planes == want).all()
    dest = torch.zeros_like(big)
    _planes.join(dest[:, :, lo : lo + tokens], list(planes))
    assert torch.equal(dest[:, :, lo : lo + tokens].view(bits), view.view(bits))
    assert not dest[:, :, :lo].view(bits).any() and not dest[:, :, lo + tokens :].view(bits).any()


def test_a_decode_bumps_the_destination_version_and_works_in_inference_mode() -> None:
    """The kernel writes through raw pointers: views and autograd still see a write, as after torch's copy."""
    buf, chunk = _v3()
    dest = torch.zeros_like(chunk)
    before = dest._version
    get_codec("lossless").decode_into(memoryview(buf), tuple(chunk.shape), chunk.dtype, dest)
    assert dest._version > before and torch.equal(dest.view(torch.int16), chunk.view(torch.int16))
    with torch.inference_mode():  # the retrieve pipeline's workers run under it
        frozen = torch.zeros_like(chunk)
        get_codec("lossless").decode_into(memoryview(buf), tuple(chunk.shape), chunk.dtype, frozen)
    assert torch.equal(frozen.view(torch.int16), chunk.view(torch.int16))


def test_the_plane_kernel_builds_on_this_machine() -> None:
    assert _planes.available(), "numba is a dependency: the byte-plane kernels must compile on x86-64"


def _v3(chunk: torch.Tensor | None = None) -> tuple[bytearray, torch.Tensor]:
    chunk = kv_like(layers=2, tokens=64, heads=2, dim=64) if chunk is None else chunk
    return roundtrip(get_codec("lossless"), chunk)[1], chunk


def _decode(buf: bytearray, chunk: torch.Tensor) -> torch.Tensor:
    return get_codec("lossless").decode(memoryview(buf), tuple(chunk.shape), chunk.dtype)


def _with_high_plane(buf: bytearray, frame: bytes) -> bytearray:
    """``buf`` with its compressed (last) plane replaced by ``frame``."""
    at, stored_as, _ = _planes_of(buf)[-1]
    assert stored_as == 1
    return buf[:at] + bytearray(_PLANE.pack(1, len(frame)) + frame)


def test_planes_and_frames_are_checked_before_decoding() -> None:
    buf, chunk = _v3()
    numel = chunk.numel()
    high = bytes(buf[_planes_of(buf)[-1][0] + _PLANE.size :])
    plane = chunk.view(-1).view(torch.uint8).view(-1, 2)[:, 1].contiguous().numpy().tobytes()
    raw_at = _HEAD.size + _PLANE.size  # the first plane's bytes: the mantissas, stored raw
    assert _planes_of(buf)[0][1:] == (0, numel)
    damaged = {
        "raw plane one byte short": buf[:_HEAD.size] + _PLANE.pack(0, numel - 1) + buf[raw_at : raw_at + numel - 1]
        + buf[raw_at + numel :],
        "unknown stored_as": bytearray(buf[:_HEAD.size]) + bytearray([7]) + buf[_HEAD.size + 1 :],
        "a plane missing": buf[: _planes_of(buf)[-1][0]],
        "a trailing byte": buf + b"\0",
        "another itemsize": bytearray([3, 4]) + buf[2:],
        "another method": bytearray([3, 2, 9]) + buf[3:],
        "frame one byte short": _with_high_plane(buf, high[:-1]),
        "bytes after the frame": _with_high_plane(buf, high + b"\0\0\0"),
        "frame of the wrong content size": _with_high_plane(buf, zstandard.ZstdCompressor().compress(plane[:-2])),
        "frame without a content size": _with_high_plane(
            buf, zstandard.ZstdCompressor(write_content_size=False).compress(plane)),
        "frame with a dictionary": _with_high_plane(buf, zstandard.ZstdCompressor(dict_data=zstandard.train_dictionary(
            2048, [bytes([i % 7, i % 13, 1, 2, 3]) * 50 + bytes(range(i % 200, i % 200 + 16)) for i in range(200)]),
        ).compress(plane)),
        "two frames": _with_high_plane(buf, zstandard.ZstdCompressor().compress(plane[: numel // 2]) +
                                       zstandard.ZstdCompressor().compress(plane[numel // 2 :])),
        "not a zstd frame": _with_high_plane(buf, b"\x28\xb5\x2f\xfe" + high[4:]),
    }
    for what, payload in damaged.items():
        with pytest.raises(CodecError):
            _decode(bytearray(payload), chunk)
            pytest.fail(what)
    other = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(plane)  # any valid frame decodes
    out = _decode(_with_high_plane(buf, other), chunk)
    assert torch.equal(out.view(torch.int16), chunk.view(torch.int16))


def test_a_frame_asking_for_a_large_window_is_refused() -> None:
    """A window over 1 MiB (this encoder writes 128 KiB) would make zstd allocate it: refused unread."""
    buf, chunk = _v3(kv_like(layers=2, tokens=256, heads=4, dim=128))  # a 512 KiB plane: a 128 KiB window
    at = _planes_of(buf)[-1][0] + _PLANE.size
    assert buf[at + 4] & 0x20 == 0  # not single-segment: a window descriptor follows the descriptor byte
    assert torch.equal(_decode(buf, chunk).view(torch.int16), chunk.view(torch.int16))
    buf[at + 5] = 16 << 3  # window log 10 + 16: 64 MiB
    with pytest.raises(CodecError, match="window"):
        _decode(buf, chunk)


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
       into_range=st.booleans())
def test_damaged_v3_payloads_fail_cleanly(edits, into_range: bool) -> None:
    """Any byte edits: a CodecError, or a decode that writes only the destination (zstd frames carry no
    checksum here; the blob's checksum is what catches a wrong but well-formed plane)."""
    buf, chunk = _v3()
    for at, value in edits:
        buf[at % len(buf)] = value
    big = torch.full((2, 2, 70, 2, 64), 7.0, dtype=torch.bfloat16)
    try:
        if into_range:
            get_codec("lossless").decode_into(memoryview(buf), tuple(chunk.shape), chunk.dtype, big[:, :, 3:67])
        else:
            out = _decode(buf, chunk)
            assert tuple(out.shape) == tuple(chunk.shape) and out.dtype == chunk.dtype
    except CodecError:
        pass
    assert (big[:, :, :3] == 7).all() and (big[:, :, 67:] == 7).all()
