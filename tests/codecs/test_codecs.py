"""Round trips, error bounds and the registry of every codec."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.base.errors import CodecError, ConfigError
from kvtier.codecs import codec_by_id, codec_names, get_codec
from kvtier.tiers import MemoryTierConfig
from tests.codecs.conftest import kv_like, roundtrip

LOSSY = ["int8", "int4", "int4-g32", "int8-g16", "cachegen", "cachegen-a4"]
ALL = ["raw", "lossless", "lossless-lz4", "lossless-z3", *LOSSY]


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def test_registry_ids_are_stable() -> None:
    assert {name: get_codec(name).codec_id for name in codec_names()} == {
        "raw": 0, "lossless": 1, "int8": 2, "int4": 3, "cachegen": 4}
    assert codec_by_id(3) is get_codec("int4")


@pytest.mark.parametrize("name", ALL)
def test_exact_flag_matches_the_round_trip(name: str) -> None:
    """``exact`` decides whether a codec may hold SSM state: it must be true exactly for bit-exact codecs."""
    codec = get_codec(name)
    chunk = kv_like(dtype=torch.float32, seed=3)
    back, _ = roundtrip(codec, chunk)
    assert codec.exact == torch.equal(back, chunk) == (name not in LOSSY)


def test_variants_by_name() -> None:
    codec = get_codec("int4-g32")
    assert (codec.codec_id, codec.group, codec.name) == (3, 32, "int4-g32")
    assert get_codec("int4-g32") is codec
    assert get_codec("lossless-lz4").codec_id == 1
    assert get_codec("cachegen-a8").anchor == 8
    for bad in ("int4-g33", "int4-x", "raw-g8", "nope", "int4-", "lossless-z99"):
        with pytest.raises(ConfigError):
            get_codec(bad)
    assert MemoryTierConfig(codec="int8-g32").codec == "int8-g32"
    with pytest.raises(ConfigError):
        MemoryTierConfig(codec="int3")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(3, 2, 20, 2, 64), (1, 2, 1, 1, 32), (2, 2, 7, 3, 48), (1, 2, 0, 2, 64)])
def test_roundtrip_shape_and_dtype(name: str, shape: tuple[int, ...]) -> None:
    chunk = kv_like(shape[0], shape[2], shape[3], shape[4])
    out, _ = roundtrip(get_codec(name), chunk)
    assert out.shape == chunk.shape and out.dtype == chunk.dtype
    if chunk.numel():
        rel = (out.float() - chunk.float()).norm() / chunk.float().norm()
        assert rel < (0.2 if "4" in name or "cachegen" in name else 0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("name", ["lossless", "lossless-lz4"])
def test_lossless_is_bit_exact(name: str, dtype: torch.dtype) -> None:
    if dtype.is_floating_point:
        chunk = kv_like(dtype=dtype)
        flat = chunk.view(-1)
        flat[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40, 0.0]).to(dtype)
    else:
        chunk = torch.randint(-128, 128, (2, 2, 9, 2, 16), dtype=dtype)
    out, _ = roundtrip(get_codec(name), chunk)
    assert out.dtype == dtype
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    assert torch.equal(out.view(bits), chunk.contiguous().view(bits))


def test_lossless_compresses_kv_like_bf16() -> None:
    chunk = kv_like(tokens=64)
    _, buf = roundtrip(get_codec("lossless"), chunk)
    assert len(buf) < 0.8 * chunk.numel() * 2


def test_lossless_accepts_strided_input() -> None:
    big = kv_like(tokens=40)
    chunk = big[:, :, 10:30]
    out, _ = roundtrip(get_codec("lossless"), chunk)
    assert torch.equal(out, chunk)


@pytest.mark.parametrize("bits,group", [(8, 64), (8, 16), (4, 32)])
def test_group_quant_error_bound_unrotated(bits: int, group: int) -> None:
    """Every element within half a (float16-rounded-up) step of its group's range."""
    from kvtier.codecs.quant import GroupQuantCodec

    codec = GroupQuantCodec(bits, group, rotate=False)
    chunk = kv_like(dtype=torch.float32, seed=bits)
    out, buf = roundtrip(codec, chunk)
    groups = chunk.reshape(-1, group)
    span = groups.amax(1).clamp_min(0) - groups.amin(1).clamp_max(0)
    step = span / (2**bits - 1) * (1 + 2**-9)
    err = (out - chunk).reshape(-1, group).abs()
    assert bool((err <= step[:, None] / 2 + 1e-6).all())
    assert len(buf) == 5 + chunk.numel() * bits // 8 + 3 * chunk.numel() // group


def test_int4_rotated_error_bound() -> None:
    """int4 rotates head vectors: the half-step bound holds per element in the rotated basis."""
    chunk = kv_like(dtype=torch.float32, seed=4)
    out, _ = roundtrip(get_codec("int4"), chunk)
    h = hadamard(64)
    rot, rot_out = chunk @ h, out @ h
    span = rot.amax(-1).clamp_min(0) - rot.amin(-1).clamp_max(0)
    step = span / 15 * (1 + 2**-9)
    assert bool(((rot_out - rot).abs() <= step[..., None] / 2 + 1e-5).all())


def test_int4_beats_unrotated_on_outlier_channels() -> None:
    from kvtier.codecs.quant import GroupQuantCodec

    chunk = kv_like(dtype=torch.float32, tokens=64)
    plain, _ = roundtrip(GroupQuantCodec(4, rotate=False), chunk)
    rotated, _ = roundtrip(get_codec("int4"), chunk)
    assert (rotated - chunk).norm() < 0.8 * (plain - chunk).norm()


def test_cachegen_error_bound_and_layer_dependence() -> None:
    codec = get_codec("cachegen")
    chunk = kv_like(layers=4, tokens=48, dtype=torch.float32, seed=7)
    out, _ = roundtrip(codec, chunk)
    rms = chunk.pow(2).mean(-1).sqrt()
    c = codec.step_factors(4).view(4, 2, 1, 1)
    step = torch.maximum(c * rms, chunk.norm(dim=-1) / 127) * (1 + 2**-9)
    err = (out - chunk).norm(dim=-1)
    assert bool((err <= step * math.sqrt(64) / 2 + 1e-5).all())
    rel = [((out[i] - chunk[i]).norm() / chunk[i].norm()).item() for i in range(4)]
    assert rel[0] < rel[-1]  # deeper layers are quantised more coarsely
    assert bool((c[:, 0] < c[:, 1]).all())  # keys more finely than values


def test_cachegen_delta_coding_pays_on_correlated_tokens() -> None:
    """Tokens that barely change inside a chunk compress far better than independent ones."""
    codec = get_codec("cachegen")
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 2, 1, 2, 64, generator=gen)
    correlated = base + 0.05 * torch.randn(2, 2, 64, 2, 64, generator=gen)
    independent = torch.randn(2, 2, 64, 2, 64, generator=gen)
    _, small = roundtrip(codec, correlated)
    _, large = roundtrip(codec, independent)
    assert len(small) < 0.8 * len(large)
    out, _ = roundtrip(codec, correlated)
    assert (out - correlated).norm() / correlated.norm() < 0.2


@pytest.mark.parametrize("tokens,anchor", [(64, 16), (37, 16), (17, 16), (5, 16), (9, 4), (33, 1), (1, 8)])
def test_cachegen_delta_coding_undoes_exactly(tokens: int, anchor: int) -> None:
    """Delta coding and its in-place inverse, on whole and partial anchor groups, wrapping mod 256."""
    from kvtier.codecs.cachegen import _delta, _undelta_

    gen = torch.Generator().manual_seed(tokens * 31 + anchor)
    slabs = torch.randint(0, 256, (3, tokens, 24), generator=gen, dtype=torch.uint8)
    coded = _delta(slabs, anchor)
    assert torch.equal(coded[:, ::anchor], slabs[:, ::anchor])  # anchor rows stored as they are
    for b in range(3):
        _undelta_(coded[b], anchor)
    assert torch.equal(coded, slabs)


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_codecs_reject_non_finite(name: str) -> None:
    chunk = kv_like()
    chunk[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(CodecError):
        get_codec(name).encode(chunk)


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_codecs_need_canonical_chunks(name: str) -> None:
    with pytest.raises(CodecError):
        get_codec(name).encode(torch.zeros(4, 3, 2, 2, 8))


@pytest.mark.parametrize("name", ["int8", "int4", "cachegen"])
def test_zero_and_constant_chunks(name: str) -> None:
    codec = get_codec(name)
    zeros = torch.zeros(2, 2, 5, 2, 64)
    assert torch.equal(roundtrip(codec, zeros)[0], zeros)
    const = torch.full((2, 2, 5, 2, 64), 3.0)
    assert torch.allclose(roundtrip(codec, const)[0], const, rtol=0.05)


@pytest.mark.parametrize("name", ALL)
def test_decode_rejects_wrong_shape_dtype_and_length(name: str) -> None:
    codec = get_codec(name)
    chunk = kv_like(layers=2, tokens=8)
    _, buf = roundtrip(codec, chunk)
    view = memoryview(buf)
    shape = tuple(chunk.shape)
    with pytest.raises(CodecError):
        codec.decode(view[:-1], shape, chunk.dtype)
    with pytest.raises(CodecError):
        codec.decode(memoryview(bytes(buf) + b"\0"), shape, chunk.dtype)
    with pytest.raises(CodecError):
        codec.decode(view, (2, 2, 9, 2, 64), chunk.dtype)
    if name not in ("int8", "int8-g16", "int4", "int4-g32", "cachegen", "cachegen-a4"):
        with pytest.raises(CodecError):  # quantised payloads decode into any float dtype; byte codecs cannot
            codec.decode(view, shape, torch.float32)


def test_int4_needs_an_even_head_dim_and_int8_takes_any() -> None:
    chunk = kv_like(layers=1, tokens=3, heads=1, dim=63, dtype=torch.float32)
    with pytest.raises(CodecError):
        get_codec("int4").encode(chunk)
    out, _ = roundtrip(get_codec("int8"), chunk)  # group falls back to gcd(64, 63) = 1
    assert bool(((out - chunk).abs() <= chunk.abs() / 255 * 0.51 + 1e-6).all())


def test_codec_families_load_on_first_use() -> None:
    """``import kvtier.codecs`` knows every family's name and id but imports a family's module only when its
    name or id is first looked up."""
    import subprocess
    import sys

    script = (
        "import sys, kvtier.codecs as c\n"
        "mods = ('kvtier.codecs.lossless', 'kvtier.codecs.quant', 'kvtier.codecs.cachegen')\n"
        "print(c.codec_names(), [m for m in mods if m in sys.modules])\n"
        "print(c.codec_by_id(3).name, [m for m in mods if m in sys.modules])\n"
        "print(c.get_codec('int8').codec_id, c.get_codec('int4-g32').name, c.codec_by_id(3) is c.get_codec('int4'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "['cachegen', 'int4', 'int8', 'lossless', 'raw'] []",
        "int4 ['kvtier.codecs.quant']",
        "2 int4-g32 True",
    ]


def test_registering_a_taken_name_or_id_is_refused() -> None:
    from kvtier.base.errors import ConfigError
    from kvtier.codecs import register_family

    with pytest.raises(ConfigError, match="already registered"):
        register_family("raw", 99, "kvtier.codecs.raw", "RawCodec")
    with pytest.raises(ConfigError, match="already registered"):
        register_family("raw2", 0, "kvtier.codecs.raw", "RawCodec")
    with pytest.raises(ConfigError, match="misnamed"):
        register_family("raw-x", 98, "kvtier.codecs.raw", "RawCodec")
    assert "raw2" not in codec_names()
