"""Streaming copies (kvtier.native.bulkcopy): bit-exact where they copy, untouched memory where they decline, and the
memory tier's large stores and retrieves going through them."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.codecs import base as codecs_base
from kvtier.native import bulkcopy


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def test_the_kernel_builds_on_this_machine() -> None:
    assert bulkcopy.available(), \
        "llvmlite is a dependency: the streaming kernel must build on the machines CI runs on (x86-64)"


def test_chunks_of_canonical_kv_copy_exactly_and_nothing_else_is_written() -> None:
    kv = torch.randn(8, 2, 1024, 4, 128).to(torch.bfloat16)  # 16 MiB: at the default threshold
    out = torch.zeros(8, 2, 1024 + 2, 4, 128, dtype=torch.bfloat16)
    pairs = [(out[:, :, 1 + i * 256 : 1 + (i + 1) * 256], kv[:, :, i * 256 : (i + 1) * 256]) for i in range(4)]
    assert bulkcopy.copy_pairs(pairs)
    assert torch.equal(_bytes(out[:, :, 1:-1]), _bytes(kv))
    assert not out[:, :, 0].any() and not out[:, :, -1].any()


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_one_long_run_is_shared_out_over_threads(threads: int) -> None:
    src = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8)
    dest = torch.zeros((40 << 20) + 128, dtype=torch.uint8)
    assert bulkcopy.copy_pairs([(dest[37 : 37 + src.numel()], src)], threads=threads)
    assert torch.equal(dest[37 : 37 + src.numel()], src)
    assert not dest[:37].any() and not dest[37 + src.numel() :].any()


def _strided(base_shape: tuple[int, ...], dtype: torch.dtype, offset: int, slices,
             fill: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A view ``slices`` of a ``base_shape`` tensor that starts ``offset`` elements into a byte buffer (off
    64-byte alignment for most offsets), and that byte buffer: random bytes, or zeros."""
    nbytes = (int(np.prod(base_shape)) + offset) * dtype.itemsize
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8) if fill else torch.zeros(nbytes, dtype=torch.uint8)
    return flat.view(dtype)[offset:].view(base_shape)[slices], flat


@st.composite
def _copy_case(draw):
    dtype = draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32]))
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 4)) for _ in range(ndim - 1)] + [draw(st.sampled_from([1, 7, 2048, 4099, 9000]))]

    def layout():
        pads = [draw(st.integers(0, 2)) for _ in shape]
        starts = [draw(st.integers(0, pad)) for pad in pads]
        base_shape = tuple(s + p for s, p in zip(shape, pads))
        return base_shape, tuple(slice(a, a + s) for a, s in zip(starts, shape)), draw(st.integers(0, 40))
    return dtype, shape, layout(), layout(), draw(st.integers(1, 3))


@given(_copy_case())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_strided_copies_match_torch_or_write_nothing(case) -> None:
    dtype, shape, (d_base, d_slices, d_off), (s_base, s_slices, s_off), threads = case
    dest, whole = _strided(d_base, dtype, d_off, d_slices, fill=False)
    reference, reference_whole = _strided(d_base, dtype, d_off, d_slices, fill=False)
    src, _ = _strided(s_base, dtype, s_off, s_slices, fill=True)
    reference.copy_(src)  # the same zeroed layout, copied by torch (compared as bytes: random bits hold NaNs)
    before = whole.clone()
    copied = bulkcopy.copy_pairs([(dest, src)], min_bytes=0, threads=threads)
    if copied:
        assert torch.equal(whole, reference_whole), "the streamed copy differs from torch's"
    else:
        assert torch.equal(whole, before), "a declined copy wrote something"
        inner_run = dest.shape[-1] * dtype.itemsize
        assert inner_run < bulkcopy.MIN_RUN_BYTES, "a plain strided copy with long runs was declined"


@given(_copy_case())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_copies_visiting_each_piece_see_the_source_in_order_or_nothing(case) -> None:
    """copy_visiting copies as torch does and hands its visitor exactly the source's bytes in row-major order (a
    checksum of them is the checksum of a contiguous copy); or declines having visited and written nothing."""
    dtype, shape, (d_base, d_slices, d_off), (s_base, s_slices, s_off), _threads = case
    dest, whole = _strided(d_base, dtype, d_off, d_slices, fill=False)
    reference, reference_whole = _strided(d_base, dtype, d_off, d_slices, fill=False)
    src, _ = _strided(s_base, dtype, s_off, s_slices, fill=True)
    reference.copy_(src)
    before = whole.clone()
    seen: list[bytes] = []
    if bulkcopy.copy_visiting(dest, src, lambda piece: seen.append(bytes(piece))):
        assert torch.equal(whole, reference_whole), "the streamed copy differs from torch's"
        assert b"".join(seen) == _bytes(src).numpy().tobytes(), "the visitor saw other bytes or another order"
        assert max(len(p) for p in seen) <= bulkcopy.VISIT_PIECE_BYTES
    else:
        assert not seen and torch.equal(whole, before), "a declined copy visited or wrote something"
        assert dest.shape[-1] * dtype.itemsize < bulkcopy.MIN_RUN_BYTES, "a copy with long runs was declined"


def test_a_visited_copy_of_long_runs_is_cut_into_pieces_that_cover_them() -> None:
    kv = torch.randint(0, 256, (4, 2, 4096, 8, 128), dtype=torch.uint8)  # a chunk's runs: 1 MiB each
    out = torch.zeros(4, 2, 1024, 8, 128, dtype=torch.uint8)
    chunk = torch.zeros(4, 2, 3 * 1024, 8, 128, dtype=torch.uint8)[:, :, 1024:2048]  # strided destination
    seen: list[int] = []
    assert bulkcopy.copy_visiting(out, kv[:, :, 1024:2048], lambda piece: seen.append(len(piece)))
    assert bulkcopy.copy_visiting(chunk, out, lambda piece: None)
    assert torch.equal(out, kv[:, :, 1024:2048]) and torch.equal(chunk, out)
    assert seen == [bulkcopy.VISIT_PIECE_BYTES] * (8 * (1 << 20) // bulkcopy.VISIT_PIECE_BYTES)


def test_declines_what_it_cannot_copy_and_writes_nothing() -> None:
    big = torch.randn(8 << 20)  # 32 MiB of float32
    dest = torch.zeros_like(big)
    cases = {
        "below the threshold": [(dest[:1024], big[:1024])],
        "dtypes differ": [(dest.view(torch.int32), big)],
        "shapes differ (broadcast)": [(dest.view(2, -1), big[: big.numel() // 2])],
        "short runs": [(dest.view(4096, 2048), big.view(2048, 4096).t())],
        "autograd": [(dest, big.clone().requires_grad_())],
        "source overlaps destination": [(big[1024:], big[:-1024])],
        "destination repeats itself": [(torch.zeros(1, 8 << 20).expand(2, -1), big.view(2, -1))],
    }
    for name, pairs in cases.items():
        assert not bulkcopy.copy_pairs(pairs), name
        assert not dest.any(), name


def test_version_counter_and_inference_tensors() -> None:
    src = torch.randn(8 << 20)
    dest = torch.empty_like(src)
    version = dest._version
    assert bulkcopy.copy_pairs([(dest, src)])
    assert dest._version > version and torch.equal(dest, src)
    with torch.inference_mode():
        frozen = torch.zeros_like(src)
    assert bulkcopy.copy_pairs([(frozen, src)]) and torch.equal(frozen, src)


def test_concurrent_callers_share_the_threads() -> None:
    srcs = [torch.randn(6 << 20) for _ in range(4)]
    dests = [torch.zeros_like(s) for s in srcs]

    def copy(i: int) -> bool:
        return all(bulkcopy.copy_pairs([(dests[i], srcs[i])], threads=2) for _ in range(3))

    with ThreadPoolExecutor(4) as callers:  # an exception in a caller is raised here
        assert all(callers.map(copy, range(4)))
    assert all(torch.equal(d, s) for d, s in zip(dests, srcs))


def test_turned_off_by_the_environment_copies_with_torch() -> None:
    code = ("import torch; from kvtier.native import bulkcopy; from kvtier.codecs.base import copy_tensors\n"
            "s = torch.randn(8 << 20); d = torch.zeros_like(s)\n"
            "assert not bulkcopy.available() and not bulkcopy.copy_pairs([(d, s)])\n"
            "copy_tensors([(d, s)]); assert torch.equal(d, s); print('torch copied')")
    env = {**os.environ, "KVTIER_STREAMING_COPY": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch copied" in done.stdout


def test_memory_tier_stores_and_retrieves_large_kv_through_streaming_copies(monkeypatch) -> None:
    spec = KVSpec(num_layers=8, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)  # 16 KiB per token
    cache = KVCache(spec, "bulkcopy-test", CacheConfig(chunk_size=256, tiers=[{"kind": "memory",
                                                                             "capacity_bytes": 64 << 20}]))
    streamed: list[int] = []
    real = codecs_base.copy_pairs

    def recording(pairs, **kwargs):
        copied = real(pairs, **kwargs)
        if copied:
            streamed.append(sum(d.numel() * d.element_size() for d, _ in pairs))
        return copied

    monkeypatch.setattr(codecs_base, "copy_pairs", recording)
    tokens = np.arange(2048, dtype=np.uint32)
    kv = torch.randn(spec.chunk_shape(2048)).to(spec.dtype)  # 32 MiB in 8 chunks
    assert cache.store(tokens, kv) == 2048
    out = torch.zeros(spec.chunk_shape(2048), dtype=spec.dtype)
    assert cache.retrieve(tokens, out)[1] == 2048
    assert torch.equal(_bytes(out), _bytes(kv))
    assert streamed == [32 << 20, 32 << 20], "store and retrieve should each stream the whole KV in one call"
