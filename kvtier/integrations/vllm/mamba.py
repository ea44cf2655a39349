"""vLLM's Mamba (SSM) KV cache groups as state snapshots: the conv and SSM state at a chunk boundary.

vLLM 0.32 keeps a Mamba layer's state per request in whole blocks of its pool, one block standing for
``block_size`` tokens of the group's block table. In its boundary-aligned prefix-caching mode
(``mamba_cache_mode: align``, the default with prefix caching on) the scheduler ends every prefill step but a
prompt's last on a block boundary, and a step that computed tokens up to ``t`` leaves the state after token ``t``
in the block at index ``ceil(t / block_size) - 1``; a request that resumes after ``t`` tokens (a prefix-cache hit
or a connector's load) continues from the state in that same block. So:

* a chunk boundary ``b`` (a multiple of the block size) that a prefill step ends on has the state after ``b``
  tokens in block ``b / block_size - 1`` once that step's forward pass is over (the next step may move on and
  free it): copied then into a snapshot of kinds ``CONV`` and ``SSM``, every Mamba layer of every Mamba group in
  one ``[layers, ...]`` tensor each (kvtier.core.snapshots stores, verifies and picks them as any snapshot);
* a load that ends at ``b`` writes the snapshot into that same block of the request's table, with the
  full-attention KV of the chunks before ``b``: the recurrence resumes exactly where the stored request was.

A boundary that falls inside a longer step has no state in any block (vLLM keeps none there either), so it is
not stored; nothing stored is a miss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier.base.errors import ConfigError
from kvtier.base.state import StateKind, StateSpec

#: vLLM's null block: the first block of its pool, standing in for states vLLM no longer keeps
NULL_BLOCK = 0


def mamba_block_size(kv_cache_config: Any, groups: Sequence[int]) -> int:
    """The tokens one block of the Mamba groups ``groups`` stands for."""
    sizes = {kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size for g in groups}
    if len(sizes) != 1:
        raise ConfigError(f"KVTierConnector needs one block size across Mamba KV cache groups, got {sorted(sizes)}")
    return sizes.pop()


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """ConfigError unless a chunk is whole Mamba blocks (a chunk boundary must have a state block)."""
    if chunk_size % block_size:
        raise ConfigError(f"kvtier chunk_size {chunk_size} must be a multiple of vLLM's Mamba block size "
                          f"{block_size} for this SSM hybrid: a chunk boundary must fall on a block boundary, where "
                          f"vLLM keeps the recurrent state (set chunk_size to {block_size} or a multiple)")


class MambaState:
    """The Mamba groups' state blocks (``layers``: per group, each layer's ``(conv, ssm)`` tensors of vLLM's pool,
    ``[blocks, ...]``): copies the state at a boundary out of a request's block and writes one back."""

    def __init__(self, layers: Sequence[Sequence[Sequence[torch.Tensor]]], block_size: int) -> None:
        self.layers, self.block_size = [list(g) for g in layers], block_size
        first = self.layers[0][0]
        if len(first) != 2:
            raise ConfigError(f"KVTierConnector restores Mamba layers of a conv and an SSM state; this model's "
                              f"keep {len(first)} state tensors per layer")
        for group in self.layers:
            for conv, ssm in group:
                if (conv.shape[1:], ssm.shape[1:], conv.dtype, ssm.dtype) != (
                        first[0].shape[1:], first[1].shape[1:], first[0].dtype, first[1].dtype):
                    raise ConfigError("KVTierConnector needs one conv and SSM state shape across Mamba layers")
        slots = sum(len(g) for g in self.layers)
        self.state_specs = (StateSpec(StateKind.CONV, slots, tuple(first[0].shape[1:]), first[0].dtype),
                            StateSpec(StateKind.SSM, slots, tuple(first[1].shape[1:]), first[1].dtype))

    @classmethod
    def from_caches(cls, names: Sequence[Sequence[str]], kv_caches: Mapping[str, Any], block_size: int,
                    order) -> MambaState:
        """``names``: each Mamba group's layer names; ``kv_caches``: vLLM's tensors by layer (a Mamba layer's is a
        list of its state tensors); ``order``: the sort key putting a group's layers in model order."""
        return cls([[tuple(kv_caches[n]) for n in sorted(group, key=order)] for group in names], block_size)

    def _blocks(self, tables: Sequence[Sequence[int]], boundary: int) -> list[int] | None:
        """Each group's block holding the state after ``boundary`` tokens; None if one holds none."""
        index = boundary // self.block_size - 1
        if boundary % self.block_size or index < 0:
            return None
        blocks = [table[index] if index < len(table) else NULL_BLOCK for table in tables]
        return None if NULL_BLOCK in blocks else blocks

    def snapshot_states(self, tables: Sequence[Sequence[int]], boundary: int) -> dict[StateKind, torch.Tensor] | None:
        """``{CONV: [layers, ...], SSM: [layers, ...]}``: the state after ``boundary`` tokens, copied out of the
        request's blocks (``tables``: one per Mamba group); None if vLLM holds no state block there."""
        blocks = self._blocks(tables, boundary)
        if blocks is None:
            return None
        convs = [conv[b] for group, b in zip(self.layers, blocks) for conv, _ in group]
        ssms = [ssm[b] for group, b in zip(self.layers, blocks) for _, ssm in group]
        return {StateKind.CONV: torch.stack(convs), StateKind.SSM: torch.stack(ssms)}

    def restore_states(self, tables: Sequence[Sequence[int]], boundary: int, first_token: int, end: int,
                       states: Mapping[StateKind, torch.Tensor]) -> None:
        """Write ``states`` (taken after ``boundary`` tokens; a load's ``end`` is its boundary) into the request's
        state block at ``boundary``: vLLM continues the request from there. ``first_token``: unused (the
        block at the load's end is the request's own, never a shared prefix-cache block)."""
        blocks = self._blocks(tables, boundary)
        if blocks is None or boundary != end:
            raise ValueError(f"no Mamba state block at token {boundary} (load to {end})")
        slot = 0
        for group, b in zip(self.layers, blocks):
            for conv, ssm in group:
                conv[b].copy_(states[StateKind.CONV][slot])
                ssm[b].copy_(states[StateKind.SSM][slot])
                slot += 1
