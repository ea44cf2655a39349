"""vLLM's KV cache groups as the connector sees them, and the sliding-window groups' windows as state snapshots.

With its hybrid KV cache manager on, vLLM 0.32 gives each kind of attention layer its own KV cache groups, every
group its own block table per request (block ids index one shared pool, so a group's layers must be read with
that group's ids). A full-attention group keeps a request's whole prefix; a sliding-window group frees the blocks
that fell out of the window and holds the null block (id 0) in their place.

So kvtier caches the two kinds differently, under one chain of chunk keys:

* the full-attention group's layers as KV chunks (one KVCache, its attention spec);
* every sliding-window layer's K and V of the last ``W`` tokens before a chunk boundary (``W``: the window rounded
  up to whole blocks) as a state snapshot of kind ``WINDOW`` at that boundary (kvtier.core.snapshots). A hit at
  boundary ``k`` needs the KV of chunks ``1..k`` and that snapshot, exactly as an SSM model's hit needs its state:
  the snapshot store's lookup, verification and policies apply unchanged. A window before a boundary below ``W``
  tokens is zero-padded in front (those positions are never written back).

``W`` covers every block vLLM keeps for a load that ends at the boundary or one token before it (vLLM always
computes the prompt's last token): it keeps the blocks from ``(end - window + 1) // block_size`` on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.base.errors import ConfigError
from kvtier.base.layout import KVSpec
from kvtier.base.state import ModelStateSpec, StateKind, StateSpec
from kvtier.integrations.vllm.mamba import MambaState, mamba_block_size
from kvtier.integrations.vllm.paged import PagedKV

#: vLLM's null block: the first block of its pool (``BlockPool``), standing in for freed out-of-window blocks
NULL_BLOCK = 0
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _layer_order(name: str) -> tuple[int, str]:
    match = _LAYER_INDEX.search(name)
    return (int(match.group(1)) if match else -1, name)


@dataclass(frozen=True)
class GroupLayout:
    """Which of vLLM's KV cache groups kvtier caches how. ``full``: the full-attention group's index (None for a
    model whose every layer slides); ``windows``: the sliding-window groups' indices; ``window``: their window
    in tokens (0 without any); ``layers``: each group's layer names; ``ssm``: the Mamba (SSM state) groups' indices,
    whose conv and SSM state at chunk boundaries is stored as snapshots (mamba.py) when vLLM keeps it per block
    (``align``: its Mamba prefix-caching mode is ``align``); without it such a model is served uncached."""

    full: int | None
    windows: tuple[int, ...]
    window: int
    layers: tuple[tuple[str, ...], ...]
    ssm: tuple[int, ...] = ()
    align: bool = False
    ssm_block: int = 0  #: the tokens one state block of the Mamba groups stands for

    @property
    def states(self) -> tuple[int, ...]:
        """The groups whose state at a chunk boundary is stored as a snapshot beside the KV chunks."""
        return self.ssm or self.windows

    @property
    def cached(self) -> bool:
        """Whether kvtier caches this model: an SSM hybrid needs vLLM's ``align`` Mamba mode, one full-attention
        group, and no sliding windows beside it."""
        return not self.ssm or (self.align and self.full is not None and not self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether requests carry several block tables or a sliding-window one (vLLM's hybrid manager is on)."""
        return bool(self.windows) or len(self.layers) > 1


#: a dense model's single full-attention group (vLLM's hybrid manager off, or nothing hybrid to manage)
SINGLE_GROUP = GroupLayout(0, (), 0, ((),))


def group_layout(kv_cache_config: Any) -> GroupLayout:
    """The layout of vLLM's ``KVCacheConfig``; ConfigError for groups kvtier cannot cache (SSM, chunked local
    attention, several full-attention groups, sliding windows of different sizes)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = list(kv_cache_config.kv_cache_groups)
    layers = tuple(tuple(g.layer_names) for g in groups)
    if len(groups) == 1 and not isinstance(groups[0].kv_cache_spec, SlidingWindowSpec | MambaSpec):
        return GroupLayout(0, (), 0, layers)  # one block table: every layer is read as before
    full, windows, sizes, ssm = [], [], set(), []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        if type(spec) is SlidingWindowSpec and not spec.extra_retained_tokens:
            windows.append(i)
            sizes.add(spec.sliding_window)
        elif type(spec) is FullAttentionSpec:
            full.append(i)
        elif isinstance(spec, MambaSpec):
            ssm.append(i)
        else:
            raise ConfigError(f"KVTierConnector cannot cache vLLM KV cache group {i} ({name}, layers "
                              f"{', '.join(group.layer_names[:3])}...): it caches full-attention and sliding-window "
                              "attention layers and Mamba (SSM) layers only")
    if ssm:
        align = all(groups[g].kv_cache_spec.mamba_cache_mode == "align" for g in ssm)
        one = full[0] if len(full) == 1 and not windows else None
        return GroupLayout(one, tuple(windows), max(sizes, default=0), layers, tuple(ssm), align,
                           mamba_block_size(kv_cache_config, ssm))
    if len(full) > 1 or len(sizes) > 1:
        raise ConfigError(f"KVTierConnector caches at most one full-attention KV cache group and one sliding window "
                          f"size; this model has {len(full)} full-attention groups and windows {sorted(sizes)}")
    return GroupLayout(full[0] if full else None, tuple(windows), sizes.pop() if sizes else 0, layers)


class StateGroups(Protocol):
    """KV cache groups whose state at a chunk boundary is stored as a snapshot beside the full-attention KV
    (``WindowKV``: sliding windows; ``mamba.MambaState``: Mamba conv and SSM states)."""

    def snapshot_states(self, tables: Sequence[Sequence[int]], boundary: int) -> dict[StateKind, torch.Tensor] | None:
        """The state before ``boundary`` in a request's blocks (``tables``: per group), or None if it has none."""

    def restore_states(self, tables: Sequence[Sequence[int]], boundary: int, first_token: int, end: int,
                       states: Mapping[StateKind, torch.Tensor]) -> None:
        """Write a snapshot's ``states`` into a request's blocks, as the state at ``boundary``."""


class WindowKV:
    """The sliding-window groups' paged KV (one PagedKV per group, in ``GroupLayout.windows`` order): gathers a
    request's window before a boundary into one snapshot and writes one back into its blocks."""

    def __init__(self, pageds: Sequence[PagedKV], window: int, block_size: int) -> None:
        self.pageds, self.block_size = list(pageds), block_size
        self.tokens = -(-window // block_size) * block_size  #: W: the window in whole blocks
        first = self.pageds[0].spec
        for paged in self.pageds:
            if (paged.spec.num_kv_heads, paged.spec.head_dim, paged.spec.dtype) != (
                    first.num_kv_heads, first.head_dim, first.dtype):
                raise ConfigError("KVTierConnector needs one KV head shape and dtype across sliding-window groups")
        self.slots = sum(p.spec.num_layers for p in self.pageds)
        self.state_spec = StateSpec(StateKind.WINDOW, self.slots, (2, self.tokens, first.num_kv_heads,
                                                                     first.head_dim), first.dtype)

    def snapshot(self, tables: Sequence[Sequence[int]], boundary: int) -> torch.Tensor | None:
        """``[slots, 2, W, heads, head_dim]``: every sliding-window layer's K and V of tokens ``[boundary - W,
        boundary)`` (zeros before token 0), copied out of the blocks; None if vLLM no longer holds one of them."""
        start = max(boundary - self.tokens, 0)
        bs = self.block_size
        parts = []
        for paged, table in zip(self.pageds, tables):
            ids = table[start // bs : boundary // bs]
            if len(ids) < (boundary - start) // bs or NULL_BLOCK in ids:
                return None
            parts.append(paged.gather(table, start, boundary))  # [layers, 2, tokens, H, D]
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        if start > boundary - self.tokens:
            pad = out.new_zeros((out.shape[0], 2, self.tokens - (boundary - start), *out.shape[3:]))
            out = torch.cat([pad, out], dim=2)
        return out.contiguous()

    def snapshot_states(self, tables: Sequence[Sequence[int]], boundary: int) -> dict[StateKind, torch.Tensor] | None:
        """``snapshot`` as a snapshot's kinds (the interface WindowKV shares with mamba.MambaState)."""
        window = self.snapshot(tables, boundary)
        return None if window is None else {StateKind.WINDOW: window}

    def restore_states(self, tables: Sequence[Sequence[int]], boundary: int, first_token: int, end: int,
                       states: Mapping[StateKind, torch.Tensor]) -> None:
        self.restore(tables, boundary, first_token, end, states[StateKind.WINDOW])

    def restore(self, tables: Sequence[Sequence[int]], boundary: int, first_token: int, end: int,
                snapshot: torch.Tensor) -> None:
        """Write ``snapshot`` (taken at ``boundary``) into the blocks of tokens ``[first_token, end)`` that each
        group holds: the null blocks (out of the window) and blocks below ``first_token`` (vLLM's own prefix-cache
        hit, possibly shared) are left alone."""
        bs, base = self.block_size, boundary - self.tokens
        slot = 0
        for paged, table in zip(self.pageds, tables):
            layers = snapshot[slot : slot + paged.spec.num_layers]
            slot += paged.spec.num_layers
            lo = max(first_token, base, 0) // bs
            hi = min(-(-end // bs), len(table))
            run = lo
            for b in range(lo, hi + 1):  # write each run of held blocks with one scatter
                if b < hi and table[b] != NULL_BLOCK:
                    continue
                if b > run:
                    paged.scatter(table, run * bs, layers[:, :, run * bs - base : b * bs - base])
                run = b + 1


def paged_groups(layout: GroupLayout, kv_caches: Mapping[str, Any], block_size: int, *,
                 rows_split: bool) -> tuple[PagedKV, StateGroups | None, KVSpec | ModelStateSpec]:
    """A worker's paged KV by group: the layers read as KV chunks (every layer, in layer order, unless the
    hybrid manager is on: then the full-attention group's, or for a model whose every layer slides any group,
    which is then only synchronised, never read), the groups stored as snapshots (sliding-window or Mamba groups),
    and the KVCache's spec."""

    def paged_of(names) -> PagedKV:
        return PagedKV([kv_caches[n] for n in sorted(names, key=_layer_order)], block_size, rows_split=rows_split)

    if not layout.hybrid:
        paged = paged_of(kv_caches)
        return paged, None, paged.spec
    full = paged_of(layout.layers[layout.full]) if layout.full is not None else None
    if layout.ssm:
        assert full is not None  # GroupLayout.cached
        mamba = MambaState.from_caches([layout.layers[g] for g in layout.ssm], kv_caches, layout.ssm_block,
                                       _layer_order)
        return full, mamba, ModelStateSpec(full.spec, mamba.state_specs)
    windows = WindowKV([paged_of(layout.layers[g]) for g in layout.windows], layout.window, block_size)
    spec = ModelStateSpec(full.spec if full is not None else None, (windows.state_spec,))
    return full or windows.pageds[0], windows, spec
