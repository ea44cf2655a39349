"""The connector's paged KV conversions over vLLM 0.32's real layouts, on the CPU and on a GPU.

Every test runs on the CPU; the ``cuda`` cases need a GPU and are reported as skipped without one. The GPU
machine has no vLLM either: the layouts are built by ``kvtier.integrations.vllm.layouts``, which the first
test checks against vLLM's own ``create_kv_cache_views`` where vLLM is installed. On a GPU the same checks
cover what only runs there: the fused indexed copies, the side streams, loads straight out of the memory
tier's pinned buffer (``settle``), loads through the staging buffers (a disk tier, a decoding codec) and
saves copied straight into the tier.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import CacheConfig, KVCache
from kvtier.integrations.vllm.layouts import LAYOUTS, reference_token, vllm_layers
from kvtier.integrations.vllm.paged import PagedKV, PagedSink, PagedSource, stack_layers
from kvtier.tiers import DiskTierConfig, MemoryTierConfig

LAYERS, BLOCKS, HEADS, KB, DIM = 3, 24, 2, 32, 16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def host(kv: torch.Tensor) -> torch.Tensor:
    """A gathered chunk on the host: on a GPU it was gathered on a side stream, so wait for that first."""
    if kv.device.type == "cuda":
        torch.cuda.synchronize()
    return kv.cpu()


def layers_on(device: str, layout: str = "LBNHC", blocks: int = BLOCKS) -> list[torch.Tensor]:
    return vllm_layers(layout, LAYERS, blocks, HEADS, KB, DIM, device=device)


def test_layout_helper_builds_vllms_own_views():
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = interface.FullAttentionSpec(block_size=KB, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
    for layout in KVCacheLayout:
        strides = interface.compute_layout_strides(spec, BLOCKS, LAYERS, layout)
        tensor = interface.KVCacheTensor(size=spec.page_size_bytes * BLOCKS * LAYERS,
                                         layers=[f"model.layers.{i}.attn" for i in range(LAYERS)],
                                         layer_stride=strides[0], block_stride=strides[1])
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        theirs = interface.create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)
        ours = layers_on("cpu", layout.name)
        assert LAYOUTS[layout.name] == layout.stride_order
        for a, b in zip(theirs, ours):
            assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(),
                                                                          b.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fused", [True, False])
def test_gather_reads_every_token_where_vllm_keeps_it(device, layout, fused):
    layers = layers_on(device, layout)
    paged = PagedKV(layers, 2 * KB, rows_split=False, fused=fused)  # scheduler blocks of 2 kernel blocks
    assert paged.stacked is not None if fused else paged.stacked is None
    block_ids = [5, 0, 9]
    chunk = PagedSource(paged, block_ids).chunk(2 * KB, 6 * KB)  # the second and third scheduler blocks
    assert chunk.shape == (LAYERS, 2, 4 * KB, HEADS, DIM) and chunk.device.type == device
    kv, layers = host(chunk), [t.cpu() for t in layers]
    for token in range(0, 4 * KB, 7):
        absolute = 2 * KB + token
        kernel_block = block_ids[absolute // (2 * KB)] * 2 + (absolute % (2 * KB)) // KB
        k, v = reference_token(layers[1], kernel_block, absolute % KB)
        assert torch.equal(kv[1, 0, token], k) and torch.equal(kv[1, 1, token], v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LHBNC"])
def test_scatter_writes_only_the_requests_blocks(device, layout):
    source = PagedKV(layers_on(device, layout), KB, rows_split=False)
    kv = host(source.gather([3, 4, 5, 6], 0, 4 * KB))  # a host chunk: staged on a GPU
    dest_layers = layers_on(device, layout)
    before = [t.clone() for t in dest_layers]
    dest = PagedKV(dest_layers, KB, rows_split=False)
    PagedSink(dest, [10, 2, 7, 1], first_token=KB).write(0, 4 * KB, kv)  # block 10 is vLLM's own: untouched
    dest.synchronize()
    assert torch.equal(host(dest.gather([2, 7, 1], 0, 3 * KB)), kv[:, :, KB:])
    touched = {2, 7, 1}
    for after, old in zip(dest_layers, before):
        for block in range(BLOCKS):
            if block not in touched:
                assert torch.equal(after[block], old[block]), block


def test_layers_in_separate_allocations_are_not_stacked():
    layers = [torch.randn(BLOCKS, HEADS, KB, 2 * DIM) for _ in range(LAYERS)]
    assert stack_layers([kv_view_of(t) for t in layers]) is None
    paged = PagedKV(layers, KB, rows_split=False, fused=True)
    assert paged.stacked is None  # fused copies layer by layer
    kv = paged.gather([4, 1], 0, 2 * KB)
    assert torch.equal(kv[2, 1, KB + 3], layers[2][1, :, 3, DIM:])


def kv_view_of(layer: torch.Tensor) -> torch.Tensor:
    from kvtier.integrations.vllm.paged import kv_view

    return kv_view(layer, rows_split=False)


def caches(tmp_path, spec) -> dict[str, KVCache]:
    """A memory tier (a GPU load copies straight out of its pinned buffer), int8 in memory (decoded into a
    reused buffer, then staged) and raw on disk (verified, then staged)."""
    tiers = {
        "memory": (MemoryTierConfig(capacity_bytes=64 << 20, prefault=False),),
        "int8": (MemoryTierConfig(capacity_bytes=64 << 20, prefault=False, codec="int8"),),
        "disk": (DiskTierConfig(path=tmp_path, capacity_bytes=64 << 20, fsync=False, o_direct=False),),
    }
    return {name: KVCache(spec, "m@1", CacheConfig(chunk_size=2 * KB, tiers=t)) for name, t in tiers.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_a_request_saved_from_blocks_loads_into_other_blocks(tmp_path, device):
    paged = PagedKV(layers_on(device, "LBNHC"), KB, rows_split=False)
    tokens = list(range(1000, 1000 + 8 * KB))
    saved_blocks = [11, 3, 4, 20, 8, 9, 0, 15]
    want = host(paged.gather(saved_blocks, 0, 8 * KB))
    for name, cache in caches(tmp_path, paged.spec).items():
        with cache:
            assert cache.store(tokens, PagedSource(paged, saved_blocks)) == 8 * KB, name
            if name == "disk":
                cache.tiers[0].flush()
            dest = PagedKV(layers_on(device, "BLNHC"), KB, rows_split=False)
            load_blocks = [1, 2, 5, 6, 7, 10, 12, 13]
            _, got = cache.retrieve(tokens, PagedSink(dest, load_blocks, first_token=0))
            dest.synchronize()
            assert got == 8 * KB, name
            loaded = host(dest.gather(load_blocks, 0, 8 * KB))
            if name == "int8":
                assert (loaded.float() - want.float()).abs().max() < 0.1, name
            else:
                assert torch.equal(loaded, want), name


@needs_cuda
def test_a_gpu_load_copies_straight_out_of_the_pinned_memory_tier():
    paged = PagedKV(layers_on("cuda"), KB, rows_split=False)
    cache = KVCache(paged.spec, "m@1", CacheConfig(chunk_size=2 * KB, tiers=(MemoryTierConfig(
        capacity_bytes=64 << 20, prefault=False),)))
    with cache:
        slab = cache.tiers[0]._slab
        assert slab.pinning == "registered" and slab.buffer.is_pinned()
        tokens = list(range(4 * KB))
        cache.store(tokens, PagedSource(paged, [0, 1, 2, 3]))
        with cache.tiers[0].get(cache.keys(tokens)) as (view, _):
            assert torch.frombuffer(view, dtype=torch.uint8).is_pinned()
        dest = PagedKV(layers_on("cuda"), KB, rows_split=False)
        direct = []
        original = dest._gpu.load

        def spy(chunk, scatter, ids):
            direct.append(chunk.is_pinned() and chunk.is_contiguous())
            original(chunk, scatter, ids)

        dest._gpu.load = spy
        _, got = cache.retrieve(tokens, PagedSink(dest, [4, 5, 6, 7], first_token=0))
        dest.synchronize()
        assert got == 4 * KB and direct == [True, True]
        assert torch.equal(host(dest.gather([4, 5, 6, 7], 0, 4 * KB)), host(paged.gather([0, 1, 2, 3], 0, 4 * KB)))
