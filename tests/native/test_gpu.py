"""Copies between the host and a GPU (kvtier.native.gpu) and the cache's paths through them.

Without a GPU only the checks that need none run; the rest are reported as skipped with that reason. On a GPU
these run the side-stream copies, the readiness events, CUDA tensors handed to ``KVCache.store`` and
``retrieve`` (raw payloads copied straight into the tier, codecs that compute handed a host copy), and the
memory tier's pinned buffer.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.codecs.base import copy_tensors
from kvtier.native import gpu
from kvtier.tiers import DiskTierConfig, MemoryTierConfig
from kvtier.tiers import slab as slab_module
from kvtier.tiers.slab import HostSlab

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine")
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
CHUNK = 64


def test_host_tensors_are_not_on_a_gpu():
    assert not gpu.on_gpu(torch.zeros(2))
    assert gpu.on_gpu(torch.zeros(2, device="meta"))  # anything but the host's memory


@needs_cuda
def test_copies_both_ways_land_before_the_call_returns():
    src = torch.randn(1 << 20, device="cuda")
    host = torch.empty(1 << 20)
    pinned = torch.empty(1 << 20, pin_memory=True)
    back = torch.empty(1 << 20, device="cuda")
    copy_tensors([(host, src), (pinned, src)])
    assert torch.equal(host, src.cpu()) and torch.equal(pinned, host)
    copy_tensors([(back, pinned)])
    assert torch.equal(back, src)


@needs_cuda
def test_a_copy_waits_for_the_event_that_marks_its_source_ready():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time on this stream before the write below
        src = torch.full((1 << 20,), 7.0, device="cuda")
    gpu.ready_after(src, stream)
    out = torch.empty(1 << 20, pin_memory=True)
    gpu.copy_pairs([(out, src)])
    assert bool((out == 7.0).all())


@needs_cuda
@pytest.mark.parametrize("codec", ["raw", "int8", "lossless"])
def test_cuda_tensors_store_and_retrieve_through_every_kind_of_tier(tmp_path, codec):
    tokens = list(range(4 * CHUNK))
    kv = torch.randn(SPEC.chunk_shape(len(tokens)), device="cuda").to(SPEC.dtype)
    for tiers in ((MemoryTierConfig(capacity_bytes=16 << 20, prefault=False, codec=codec),),
                  (DiskTierConfig(path=tmp_path / codec, capacity_bytes=16 << 20, fsync=False, codec=codec),)):
        with KVCache(SPEC, "m@1", CacheConfig(chunk_size=CHUNK, tiers=tiers)) as cache:
            assert cache.store(tokens, kv) == len(tokens)
            if tiers[0].kind == "disk":
                cache.tiers[0].flush()
            out = torch.zeros_like(kv)
            _, n = cache.retrieve(tokens, out)
            assert n == len(tokens)
            if codec == "int8":
                assert (out.float() - kv.float()).abs().max() < 0.1
            else:
                assert torch.equal(out, kv)


@needs_cuda
def test_the_memory_tiers_buffer_is_pinned_in_place_without_rounding_up():
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    capacity = (48 << 20) + (6 << 20)  # not a power of two: torch's pinned allocator would round it to 64 MiB
    slab = HostSlab(capacity, prefault=False)
    assert slab.pinning == "registered" and slab.buffer.is_pinned() and slab.buffer.numel() == capacity
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before  # not torch's allocator
    chunk = torch.randn(1 << 20, device="cuda")
    dest = slab.buffer[: 4 << 20].view(torch.float32)
    copy_tensors([(dest, chunk)])
    assert torch.equal(dest, chunk.cpu())


def test_without_cuda_the_buffer_is_not_pinned():
    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    assert HostSlab(4 << 20, prefault=False).pinning == "none"


@needs_cuda
def test_where_registering_fails_the_buffer_comes_pinned_from_torch(monkeypatch):
    monkeypatch.setattr(slab_module, "_register", lambda buffer: False)
    slab = HostSlab(4 << 20, prefault=False)
    assert slab.pinning == "allocated" and slab.buffer.is_pinned() and slab.buffer.numel() == 4 << 20


@needs_cuda
def test_where_cuda_cannot_start_the_buffer_stays_pageable(monkeypatch):
    def refuse(buffer):
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")

    monkeypatch.setattr(slab_module, "_register", refuse)
    slab = HostSlab(4 << 20, prefault=False)
    assert slab.pinning == "none" and not slab.buffer.is_pinned()
