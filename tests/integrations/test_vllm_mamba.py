"""The connector's view of vLLM's Mamba state blocks (mamba.py): the conv and SSM state after a chunk boundary
copied out of the block vLLM keeps for that position and written back into a request's block there."""

from __future__ import annotations

import pytest
import torch

from kvtier.base.errors import ConfigError
from kvtier.base.state import StateKind
from kvtier.integrations.vllm.mamba import NULL_BLOCK, MambaState, check_chunk_size

BS, BLOCKS = 64, 12


def state(layers: tuple[int, ...] = (2, 1)) -> MambaState:
    """Mamba groups of ``layers`` layers each; every layer a conv ``[blocks, 6, 3]`` and SSM ``[blocks, 2, 4, 5]``
    pool of random values."""
    torch.manual_seed(0)
    groups = [[(torch.randn(BLOCKS, 6, 3), torch.randn(BLOCKS, 2, 4, 5)) for _ in range(n)] for n in layers]
    return MambaState(groups, BS)


def test_a_snapshot_is_the_state_block_at_the_boundary_of_every_layer() -> None:
    mamba = state()
    assert [s.slots for s in mamba.state_specs] == [3, 3]
    tables = ([NULL_BLOCK, NULL_BLOCK, 7], [NULL_BLOCK, NULL_BLOCK, 4])
    snap = mamba.snapshot_states(tables, 3 * BS)
    (g0, g1) = mamba.layers
    assert torch.equal(snap[StateKind.CONV], torch.stack([g0[0][0][7], g0[1][0][7], g1[0][0][4]]))
    assert torch.equal(snap[StateKind.SSM], torch.stack([g0[0][1][7], g0[1][1][7], g1[0][1][4]]))
    assert mamba.snapshot_states(tables, 2 * BS) is None  # vLLM keeps no state there (null block)
    assert mamba.snapshot_states(tables, 3 * BS - 1) is None  # not a block boundary
    assert mamba.snapshot_states(tables, 5 * BS) is None  # beyond the table


def test_restore_writes_the_state_into_the_requests_block_and_nowhere_else() -> None:
    source, target = state(), state()
    snap = source.snapshot_states(([1, 2], [3, 5]), 2 * BS)
    before = [(c.clone(), s.clone()) for g in target.layers for c, s in g]
    target.restore_states(([NULL_BLOCK, 9], [NULL_BLOCK, 10]), 2 * BS, 0, 2 * BS, snap)
    got = target.snapshot_states(([NULL_BLOCK, 9], [NULL_BLOCK, 10]), 2 * BS)
    assert all(torch.equal(got[k], snap[k]) for k in snap)
    blocks = [9, 9, 10]
    for (conv, ssm), (old_conv, old_ssm), b in zip([x for g in target.layers for x in g], before, blocks):
        keep = [i for i in range(BLOCKS) if i != b]
        assert torch.equal(conv[keep], old_conv[keep]) and torch.equal(ssm[keep], old_ssm[keep])
    with pytest.raises(ValueError):  # a load always ends at its boundary
        target.restore_states(([NULL_BLOCK, 9], [NULL_BLOCK, 10]), 2 * BS, 0, 2 * BS + 1, snap)


def test_chunks_must_be_whole_mamba_blocks_and_layers_alike() -> None:
    check_chunk_size(128, BS)
    with pytest.raises(ConfigError, match="chunk_size 96 must be a multiple of vLLM's Mamba block size 64"):
        check_chunk_size(96, BS)
    with pytest.raises(ConfigError, match="one conv and SSM state shape"):
        MambaState([[(torch.zeros(4, 6, 3), torch.zeros(4, 2)), (torch.zeros(4, 6, 2), torch.zeros(4, 2))]], BS)
