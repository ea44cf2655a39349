"""The dequantisation kernels: int8 bit-identical to the torch path it replaces, int4 (a Hadamard transform by
butterflies instead of a matrix product) equal to float32 rounding; both inside the destination only, and
declined (torch decodes) where they do not fit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.codecs import _dequant, get_codec
from tests.codecs.conftest import kv_like, roundtrip

BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
KERNEL_FUZZ = settings(max_examples=60, deadline=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _decode_both(monkeypatch, name: str, chunk: torch.Tensor, out_dtype: torch.dtype, lo: int, hi: int):
    """(kernel result, torch result): the chunk decoded into tokens [lo, lo + T) of a larger zeroed tensor."""
    codec = get_codec(name)
    _, buf = roundtrip(codec, chunk)
    layers, two, tokens, heads, dim = chunk.shape
    results = []
    for kernel in (True, False):
        with monkeypatch.context() as patch:
            if not kernel:
                patch.setattr(_dequant, "_kernels", lambda: None)
            big = torch.zeros(layers, two, lo + tokens + hi, heads, dim, dtype=out_dtype)
            codec.decode_into(memoryview(buf), tuple(chunk.shape), chunk.dtype, big[:, :, lo : lo + tokens])
            results.append(big)
    return results


@KERNEL_FUZZ
@given(name=st.sampled_from(["int8", "int8-g32", "int8-g16"]), dims=st.tuples(st.integers(1, 3), st.integers(1, 40),
       st.integers(1, 3)), dim=st.sampled_from([64, 128]), out_dtype=st.sampled_from([torch.bfloat16, torch.float16,
       torch.float32]), lo=st.integers(0, 4), hi=st.integers(0, 4), seed=st.integers(0, 1000))
def test_the_int8_kernel_writes_what_torch_writes(monkeypatch, name, dims, dim, out_dtype, lo, hi, seed) -> None:
    layers, tokens, heads = dims
    chunk = kv_like(layers=layers, tokens=tokens, heads=heads, dim=dim, seed=seed)
    kernel, reference = _decode_both(monkeypatch, name, chunk, out_dtype, lo, hi)
    bits = BITS[out_dtype.itemsize]
    assert torch.equal(kernel.view(bits), reference.view(bits))
    assert not kernel[:, :, :lo].view(bits).any() and not kernel[:, :, lo + tokens :].view(bits).any()


def test_large_values_round_as_torch_rounds(monkeypatch) -> None:
    """Values beyond fp16's range become inf in both paths; bf16 rounds ties to even in both."""
    chunk = (kv_like(layers=2, tokens=16, heads=2, dim=64).float() * 3000).to(torch.bfloat16)
    kernel, reference = _decode_both(monkeypatch, "int8", chunk, torch.float16, 1, 1)
    assert torch.isinf(kernel.float()).any(), "no value overflowed fp16: the test lost its point"
    assert torch.equal(kernel.view(torch.int16), reference.view(torch.int16))
    kernel, reference = _decode_both(monkeypatch, "int8", chunk, torch.bfloat16, 1, 1)
    assert torch.equal(kernel.view(torch.int16), reference.view(torch.int16))


@KERNEL_FUZZ
@given(name=st.sampled_from(["int4", "int4-g32", "int4-g16", "cachegen", "cachegen-a4"]), dims=st.tuples(
       st.integers(1, 3), st.integers(1, 40), st.integers(1, 3)), dim=st.sampled_from([16, 64, 128, 256]),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), lo=st.integers(0, 4),
       hi=st.integers(0, 4), seed=st.integers(0, 1000))
def test_the_rotating_kernels_rotate_back_as_the_matrix_product_does(monkeypatch, name, dims, dim, out_dtype, lo, hi,
                                                                      seed) -> None:
    """int4's codes and cachegen's signed symbols (one step per vector) through the same butterflies."""
    layers, tokens, heads = dims
    chunk = kv_like(layers=layers, tokens=tokens, heads=heads, dim=dim, seed=seed)
    kernel, reference = _decode_both(monkeypatch, name, chunk, out_dtype, lo, hi)
    tolerance = 2.0**-7 if out_dtype.itemsize == 2 else 1e-5  # one bf16 ulp; float32 rounding
    torch.testing.assert_close(kernel.float(), reference.float(), rtol=tolerance, atol=1e-4 * float(chunk.abs().max()))
    bits = BITS[out_dtype.itemsize]
    assert not kernel[:, :, :lo].view(bits).any() and not kernel[:, :, lo + tokens :].view(bits).any()


@pytest.mark.parametrize("name,out_dtype,dim", [("int8-g8", torch.bfloat16, 64), ("int8", torch.float64, 64),
                                                ("int4", torch.bfloat16, 8), ("int4", torch.float64, 64),
                                                ("cachegen", torch.bfloat16, 8), ("cachegen", torch.float64, 64)])
def test_where_the_kernel_does_not_fit_torch_decodes(monkeypatch, name: str, out_dtype: torch.dtype, dim: int) -> None:
    """Groups of 8 values (not a multiple of 16), 8-point rotations and float64 destinations are declined, and
    still decode (as the torch path decodes them)."""
    calls = []
    family = name.split("-")[0]
    kernel_of = {"int8": "dequantise_int8", "int4": "dequantise_int4_rotated",
                 "cachegen": "dequantise_symbols_rotated"}[family]
    module = "cachegen" if family == "cachegen" else "quant"
    original = getattr(_dequant, kernel_of)
    monkeypatch.setattr(f"kvtier.codecs.{module}.{kernel_of}", lambda *a: calls.append(original(*a)) or calls[-1])
    chunk = kv_like(layers=2, tokens=8, heads=2, dim=dim)
    out = torch.zeros(chunk.shape, dtype=out_dtype)
    codec = get_codec(name)
    _, buf = roundtrip(codec, chunk)
    calls.clear()
    codec.decode_into(memoryview(buf), tuple(chunk.shape), chunk.dtype, out)
    assert calls == [False]  # declined: torch decoded it
    monkeypatch.setattr(f"kvtier.codecs.{module}.{kernel_of}", lambda *a: False)
    assert torch.equal(out.to(chunk.dtype), codec.decode(memoryview(buf), tuple(chunk.shape), chunk.dtype))


def test_the_dequantisation_kernels_build_on_this_machine() -> None:
    assert _dequant.available(), "numba and llvmlite are dependencies: the dequantisation kernels must build on x86-64"
