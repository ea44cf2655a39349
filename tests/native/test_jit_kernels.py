"""The numba kernels (kvtier.native.jit and the codecs' kernels) against numpy and torch references: the float
conversions on every kind of value, runs of odd lengths at odd offsets, the span a kernel sees, and the
decorator's promises (no GIL; no cache directory is no failure)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.codecs import _dequant, _planes
from kvtier.native import kernels

jit = pytest.importorskip("kvtier.native.jit")
from kvtier.codecs import _dequant_kernels, _plane_kernels  # noqa: E402


@jit.kernel
def _convert(values, f16, bf16, f32):
    for i in range(values.size):
        f16[i] = jit.f16_bits(values[i])
        bf16[i] = jit.bf16_bits(values[i])
        f32[i] = jit.f32_bits(values[i])


def _special_floats() -> np.ndarray:
    """Random bit patterns (every exponent: subnormals, infinities, NaNs), float16 and bfloat16 ties and their
    neighbours, the edges of float16's range."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 4096, dtype=np.uint32) << 16) | 0x8000  # exactly halfway for bfloat16
    half_ties = (np.arange(-4096, 4096, dtype=np.float32) + np.float32(0.5)).view(np.uint32)  # ties for float16
    edges = np.array([65504, 65519.99, 65520, 65536, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 0, -0.0], np.float32)
    more = np.concatenate([ties, half_ties, edges.view(np.uint32)])
    values = np.concatenate([bits, more, more + 1, more - 1]).view(np.float32)
    with np.errstate(invalid="ignore"):
        return np.concatenate([values, values * np.float32(2.0**-14)])  # and scaled into float16's subnormals


def test_float_conversions_round_as_numpy_and_torch_do() -> None:
    values = _special_floats()
    f16, bf16, f32 = (np.empty(values.size, t) for t in (np.uint16, np.uint16, np.uint32))
    _convert(values, f16, bf16, f32)
    assert (f32 == values.view(np.uint32)).all()
    nan = np.isnan(values)
    with np.errstate(over="ignore"):
        assert (f16[~nan] == values[~nan].astype(np.float16).view(np.uint16)).all()
    assert np.isnan(f16.view(np.float16)[nan]).all()
    want = torch.from_numpy(values[~nan]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (bf16[~nan] == want).all()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), g=st.sampled_from([16, 32, 64]),
       shape=st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 4)), cut=st.tuples(
       st.integers(0, 3), st.integers(0, 3), st.integers(0, 2)), seed=st.integers(0, 2**16))
def test_int8_dequantisation_matches_numpy_on_odd_runs(dtype, g, shape, cut, seed) -> None:
    """Destinations cut out of a larger tensor in every dimension (runs as short as one group, starting at odd
    offsets), against numpy's float32 arithmetic rounded by torch."""
    rng = np.random.default_rng(seed)
    full = tuple(s + c + 1 for s, c in zip(shape, cut)) + (g,)
    big = torch.zeros(full, dtype=dtype)
    out = big[cut[0] : cut[0] + shape[0], cut[1] : cut[1] + shape[1], cut[2] : cut[2] + shape[2]]
    n = out.numel()
    codes = rng.integers(0, 256, n, dtype=np.uint8)
    scale = (rng.standard_normal(n // g) * 0.05).astype(np.float32)
    zero = rng.uniform(0, 255, n // g).astype(np.float32)
    assert _dequant.dequantise_int8(out, torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(zero), g)
    reference = ((codes.astype(np.float32).reshape(-1, g) - zero[:, None]) * scale[:, None]).reshape(out.shape)
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    assert torch.equal(out.view(bits), torch.from_numpy(reference).to(dtype).view(bits))
    rest = big.clone()
    rest[cut[0] : cut[0] + shape[0], cut[1] : cut[1] + shape[1], cut[2] : cut[2] + shape[2]] = 0
    assert not rest.view(bits).any(), "written outside the destination"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_planes_of_one_element_runs_at_odd_offsets(dtype: torch.dtype, step: int) -> None:
    """Every other (or third) element of a tensor that starts one element in: runs of one element."""
    k = dtype.itemsize
    flat = torch.randint(-(2**15), 2**15, (1 + 7 * 33 * step,), dtype=torch.int32).to({2: torch.int16,
                                                                                      4: torch.int32}[k])
    view = flat.view(dtype)[1:].view(7, 33 * step)[:, ::step]
    planes = np.empty((k, view.numel()), np.uint8)
    _planes.split(view, planes)
    want = view.contiguous().view(torch.uint8).view(-1, k).t().numpy()
    assert (planes == want).all()
    dest = torch.zeros_like(flat)
    _planes.join(dest.view(dtype)[1:].view(7, 33 * step)[:, ::step], list(planes))
    assert torch.equal(dest.view(dtype)[1:].view(7, 33 * step)[:, ::step].view(flat.dtype), view.view(flat.dtype))
    dest.view(dtype)[1:].view(7, 33 * step)[:, ::step] = 0
    assert not dest.any(), "written outside the destination"


def test_span_covers_the_runs_and_nothing_before_them() -> None:
    base = torch.arange(5 * 6 * 8, dtype=torch.float32).view(5, 6, 8)
    view = base[1:4, 2:5, 1:7]
    memory, starts, run = kernels.span(view, np.float32)
    assert run == 6 and len(starts) == 9
    assert memory.ctypes.data == view.data_ptr() and memory.size == int(starts.max()) + run
    got = np.concatenate([memory[s : s + run] for s in starts])
    assert (got == view.reshape(-1).numpy()).all()
    assert kernels.span(torch.zeros(1, 8).expand(3, 8), np.float32) is None  # repeats itself


def test_every_kernel_runs_without_the_gil_and_is_cached() -> None:
    """nogil: the pool threads that decode chunks run kernels in parallel; a cache where the package is
    writable (as here), so that a test process loads machine code instead of compiling it."""
    writable = os.access(os.path.dirname(_plane_kernels.__file__), os.W_OK)
    for dispatcher in (_plane_kernels.join2, _plane_kernels.join4, _plane_kernels.split2, _plane_kernels.split4,
                       _dequant_kernels.dequant8):
        assert dispatcher.targetoptions.get("nogil") is True, dispatcher
        assert not writable or dispatcher._cache.__class__.__name__ == "FunctionCache", dispatcher


def test_no_writable_cache_directory_compiles_in_the_process(monkeypatch) -> None:
    caching = pytest.importorskip("numba.core.caching")
    if not hasattr(caching, "CacheImpl"):
        pytest.skip("numba's cache locators moved")
    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", [])

    def add_one(x):
        return x + 1

    compiled = jit.kernel(add_one)
    assert compiled(2) == 3 and compiled._cache.__class__.__name__ == "NullCache"

