"""The connector's view of vLLM's KV cache groups (groups.py): which groups it caches how, and the sliding-window
snapshots it takes out of a request's blocks and writes back, null blocks and vLLM's own hit left alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.base.errors import ConfigError
from kvtier.base.state import StateKind
from kvtier.integrations.vllm.groups import NULL_BLOCK, WindowKV, group_layout
from kvtier.integrations.vllm.layouts import vllm_layers
from kvtier.integrations.vllm.paged import PagedKV

BS, HEADS, DIM = 32, 2, 8


def config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.attn"], spec)
                                            for i, spec in enumerate(specs)])


def full():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32)


def sliding(window: int = 96):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32,
                             sliding_window=window)


def test_group_layouts() -> None:
    dense = group_layout(config(full()))
    assert (dense.full, dense.windows, dense.hybrid) == (0, (), False)
    gemma = group_layout(config(sliding(), sliding(), full(), sliding()))
    assert (gemma.full, gemma.windows, gemma.window, gemma.hybrid) == (2, (0, 1, 3), 96, True)
    mistral = group_layout(config(sliding()))
    assert (mistral.full, mistral.windows, mistral.hybrid) == (None, (0,), True)
    with pytest.raises(ConfigError, match="one sliding window size"):
        group_layout(config(full(), sliding(64), sliding(96)))
    with pytest.raises(ConfigError, match="at most one full-attention"):
        group_layout(config(full(), full(), sliding()))


def test_mamba_groups_are_cached_in_align_mode_only_and_other_groups_refused() -> None:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    mamba = MambaSpec(block_size=64, shapes=((4, 8),), dtypes=(torch.float32,))
    hybrid = group_layout(config(full(), mamba, mamba))
    assert (hybrid.ssm, hybrid.full, hybrid.windows, hybrid.cached) == ((1, 2), 0, (), False)  # mode "none"
    align = MambaSpec(block_size=64, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align")
    hybrid = group_layout(config(full(), align, align))
    assert (hybrid.ssm, hybrid.full, hybrid.states, hybrid.cached, hybrid.ssm_block) == ((1, 2), 0, (1, 2), True, 64)
    assert not group_layout(config(align)).cached  # no attention layer: pure Mamba2 is served uncached
    assert not group_layout(config(full(), sliding(), align)).cached
    local = ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32,
                                      attention_chunk_size=64)
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec"):
        group_layout(config(full(), local))


def windows(layers=(1, 2)) -> WindowKV:
    torch.manual_seed(0)
    pageds = [PagedKV(vllm_layers("LBHNC", n, 24, HEADS, BS, DIM, torch.float32), BS, rows_split=False)
              for n in layers]
    return WindowKV(pageds, 96, BS)


def tokens_of(paged: PagedKV, table, start: int, end: int) -> torch.Tensor:
    return paged.gather(table, start, end)


def test_snapshot_takes_the_window_before_a_boundary() -> None:
    kv = windows()
    assert kv.state_spec.kind is StateKind.WINDOW and kv.state_spec.snapshot_shape == (3, 2, 96, HEADS, DIM)
    # blocks 0-4 of the request left the window (vLLM's null block), 5-7 are held
    tables = ([NULL_BLOCK] * 5 + [3, 9, 4], [NULL_BLOCK] * 5 + [7, 2, 11])
    snap = kv.snapshot(tables, 256)
    assert snap is not None and snap.shape == (3, 2, 96, HEADS, DIM)
    assert torch.equal(snap[:1], tokens_of(kv.pageds[0], tables[0], 160, 256))
    assert torch.equal(snap[1:], tokens_of(kv.pageds[1], tables[1], 160, 256))
    # a window that reaches a freed block cannot be taken whole
    assert kv.snapshot(tables, 224) is None
    # before token 96, the front of the window is zeros
    short = kv.snapshot(([5, 6], [8, 10]), 64)
    assert torch.equal(short[:, :, :32], torch.zeros_like(short[:, :, :32]))
    assert torch.equal(short[:1, :, 32:], tokens_of(kv.pageds[0], [5, 6], 0, 64))


def test_restore_writes_only_held_blocks_above_vllms_hit() -> None:
    kv = windows()
    source = ([NULL_BLOCK] * 5 + [3, 9, 4], [NULL_BLOCK] * 5 + [7, 2, 11])
    snap = kv.snapshot(source, 256)
    # a load ending one token before the boundary: vLLM holds blocks 5-7; block 5 is its own (shared) hit
    target = ([NULL_BLOCK] * 5 + [12, 13, 14], [NULL_BLOCK] * 5 + [15, 16, 17])
    before = [[p.gather([b], 0, BS).clone() for b in range(24)] for p in kv.pageds]
    kv.restore(target, 256, first_token=192, end=255, snapshot=snap)
    for g, paged in enumerate(kv.pageds):
        assert torch.equal(paged.gather(target[g], 192, 256), tokens_of(paged, source[g], 192, 256))
        for b in set(range(24)) - set(target[g][6:]):  # the null block and vLLM's hit (block 5) included
            assert torch.equal(paged.gather([b], 0, BS), before[g][b]), f"group {g} block {b} was written"


def test_paged_groups_read_each_group_in_layer_order() -> None:
    from kvtier.integrations.vllm.groups import GroupLayout, paged_groups

    layers = vllm_layers("LBHNC", 4, 8, HEADS, BS, DIM, torch.float32)
    caches = {f"model.layers.{i}.attn": t for i, t in enumerate(layers)}
    paged, windows, spec = paged_groups(group_layout(config(full())), {"model.layers.0.attn": layers[0]}, BS,
                                        rows_split=False)
    assert windows is None and spec == paged.spec and spec.num_layers == 1
    layout = GroupLayout(1, (0, 2), 96, (("model.layers.2.attn", "model.layers.0.attn"), ("model.layers.1.attn",),
                                         ("model.layers.3.attn",)))
    paged, windows, spec = paged_groups(layout, caches, BS, rows_split=False)
    def ptr(layer: torch.Tensor) -> int:
        return PagedKV([layer], BS, rows_split=False).views[0].data_ptr()

    assert paged.spec.num_layers == 1 and paged.views[0].data_ptr() == ptr(layers[1])  # the full-attention group
    assert [p.spec.num_layers for p in windows.pageds] == [2, 1]
    assert [v.data_ptr() for v in windows.pageds[0].views] == [ptr(layers[0]), ptr(layers[2])]  # layer order
    assert spec.attention == paged.spec and spec.states == (windows.state_spec,)
