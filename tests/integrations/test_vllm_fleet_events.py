"""The router's own definitions of vLLM's KV-event wire format (kvtier.fleet.vllm_wire) against vLLM's classes:
what vLLM's encoder writes decodes to the same fields, the tags are vLLM's class names, and the router's
index of the connector's forwarded events equals what it computes from the prompt."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.distributed import kv_events as vllm  # noqa: E402

from kvtier.fleet import vllm_wire  # noqa: E402
from kvtier.fleet.index import FleetIndex  # noqa: E402
from kvtier.fleet.vllm_index import VllmReplicaIndex, vllm_namespace  # noqa: E402


def test_what_vllm_encodes_decodes_field_for_field():
    events = [
        vllm.BlockStored(block_hashes=[b"h" * 32, 7], parent_block_hash=b"p" * 32, token_ids=[1, 2, 3, 4],
                         block_size=2, lora_id=None, medium=vllm.MEDIUM_GPU, lora_name=None,
                         extra_keys=[None, ("salt",)], group_idx=0, locality="LOCAL", ownership="kvtier"),
        vllm.BlockRemoved(block_hashes=[b"h" * 32], medium=vllm.MEDIUM_CPU, locality="REMOTE"),
        vllm.AllBlocksCleared(),
    ]
    payload = msgspec.msgpack.encode(vllm.KVEventBatch(ts=12.5, events=events, data_parallel_rank=1))
    batch = vllm_wire.decode_batch(payload)
    assert batch.ts == 12.5 and batch.dropped == 0
    stored, removed, cleared = batch.events
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium) == (
        [b"h" * 32, 7], b"p" * 32, [1, 2, 3, 4], 2, "GPU")
    assert stored.extra_keys == [None, ["salt"]]
    assert (removed.block_hashes, removed.medium) == ([b"h" * 32], "CPU")
    assert isinstance(cleared, vllm_wire.AllBlocksCleared)


def test_the_definitions_use_vllms_tags_and_field_names():
    for ours in (vllm_wire.BlockStored, vllm_wire.BlockRemoved, vllm_wire.AllBlocksCleared):
        theirs = getattr(vllm, ours.__name__)
        assert ours.__struct_config__.tag == theirs.__struct_config__.tag == ours.__name__
        assert set(ours.__struct_fields__) <= set(theirs.__struct_fields__)
    assert vllm_wire.END_SEQ.to_bytes(8, "big", signed=True) == vllm.ZmqEventPublisher.END_SEQ


def test_the_connectors_forwarded_chunks_index_as_the_prompts_blocks():
    """A chain of kvtier chunks (4 blocks each) as the connector publishes it, through vLLM's encoder: the router
    finds the prompt's blocks in the CPU medium, and a move to DISK without tokens by the chunks' hashes."""
    from kvtier.core.events import ChunkEvent, ChunkEventKind, EntryKind
    from kvtier.integrations.vllm.events import to_vllm

    block, chunk = 8, 32
    prompt = list(range(500, 500 + 3 * chunk + 5))
    keys = [bytes([i]) * 32 for i in range(3)]
    stores = [ChunkEvent(ChunkEventKind.STORED, "memory", keys[i], i, keys[i - 1] if i else None,
                         np.asarray(prompt[i * chunk:(i + 1) * chunk], "<u4").tobytes(), EntryKind.CHUNK)
              for i in range(3)]
    moved = ChunkEvent(ChunkEventKind.STORED, "disk", keys[0])
    out = to_vllm([*stores, moved], chunk)
    payload = msgspec.msgpack.encode(vllm.KVEventBatch(ts=0.0, events=out))
    index = FleetIndex(replicas=1)
    sink = VllmReplicaIndex(index.holdings("r"), block, ("GPU", "CPU", "DISK"))
    sink.reset()
    sink.apply(vllm_wire.decode_batch(payload))
    assert index.cached("r", vllm_namespace(block).chunk_hashes(prompt)) == {"CPU": 3 * chunk // block}
    assert index.chunks("r") == {"GPU": 0, "CPU": 12, "DISK": 4}
    assert sink.counts == {"stored": 3}


def _chain(tokens, chunk, tier="memory"):
    from kvtier.core.events import ChunkEvent, ChunkEventKind, EntryKind

    keys = [bytes([i + 1]) * 32 for i in range(len(tokens) // chunk)]
    return keys, [ChunkEvent(ChunkEventKind.STORED, tier, keys[i], i, keys[i - 1] if i else None,
                             np.asarray(tokens[i * chunk:(i + 1) * chunk], "<u4").tobytes(), EntryKind.CHUNK)
                  for i in range(len(keys))]


def _removal(tier):
    from kvtier.core.events import ChunkEvent, ChunkEventKind

    return [ChunkEvent(ChunkEventKind.REMOVED, tier, bytes([2]) * 32)]


def test_chunks_published_as_vllm_sized_blocks_chain_and_remove_whole():
    """event_block_size: a 32-token chunk as four 8-token blocks (what vllm-router, which indexes only blocks of
    its --kv-event-block-size, needs); the chain's parents stay the chunk keys, a removal names every block, and
    the router's index finds the prompt's blocks as with chunk-sized blocks."""
    from kvtier.core.events import ChunkEvent, ChunkEventKind
    from kvtier.integrations.vllm.events import block_keys, to_vllm

    block, chunk = 8, 32
    prompt = list(range(700, 700 + 2 * chunk + 3))
    keys, stores = _chain(prompt, chunk)
    [stored] = to_vllm(stores, chunk, block_size=block)
    assert stored.block_size == block and len(stored.block_hashes) == 8 and stored.token_ids == prompt[:2 * chunk]
    assert stored.block_hashes[3] == keys[0] and stored.block_hashes[7] == keys[1]  # the next chunk's parent
    assert len(set(stored.block_hashes)) == 8 and all(len(h) == 32 for h in stored.block_hashes)
    [removed] = to_vllm([ChunkEvent(ChunkEventKind.REMOVED, "memory", keys[1])], chunk, block_size=block)
    assert removed.block_hashes == block_keys(keys[1], 4) == stored.block_hashes[4:]
    assert to_vllm(stores, chunk)[0].block_hashes == keys  # the default: one block per chunk

    index = FleetIndex(replicas=1)
    sink = VllmReplicaIndex(index.holdings("r"), block, ("GPU", "CPU", "DISK"))
    sink.reset()
    sink.apply(vllm_wire.decode_batch(msgspec.msgpack.encode(vllm.KVEventBatch(ts=0.0, events=[stored]))))
    assert index.cached("r", vllm_namespace(block).chunk_hashes(prompt)) == {"CPU": 2 * chunk // block}
    sink.apply(vllm_wire.decode_batch(msgspec.msgpack.encode(vllm.KVEventBatch(ts=1.0, events=[removed]))))
    assert index.cached("r", vllm_namespace(block).chunk_hashes(prompt)) == {"CPU": chunk // block}


def test_each_tier_is_published_as_what_it_costs():
    """The names published, per tier: memory CPU and disk DISK without an ownership (the replica's own host
    memory and disk, as vLLM's CPU offloading publishes them), a shared store SHARED, REMOTE, with kvtier's
    ownership. vllm-router credits any block with an ownership as its external tier whatever the medium, and a
    block without one by medium (an unknown one, as SHARED, as the device's): so memory and disk are weighted as
    host and disk, and a shared store as external, never as vLLM's own cache. ``event_ownership`` "all" puts
    the ownership on every tier (as before), "none" on none."""
    from kvtier.integrations.vllm.events import EventMedia, to_vllm

    def published(mode: str) -> dict:
        media = EventMedia(shared=frozenset({"redis"}), ownership_mode=mode)
        out = {}
        for tier in ("memory", "disk", "redis"):
            stored, removed = to_vllm(_chain(list(range(64)), 32, tier)[1] + _removal(tier), 32, media)
            assert (removed.medium, removed.locality, removed.ownership) == (
                stored.medium, stored.locality, stored.ownership)  # a removal names what its store named
            out[tier] = (stored.medium, stored.locality, stored.ownership)
        return out

    assert published("shared") == {"memory": ("CPU", "LOCAL", None), "disk": ("DISK", "LOCAL", None),
                                   "redis": ("SHARED", "REMOTE", "kvtier")}
    assert {t: o for t, (_, _, o) in published("all").items()} == {t: "kvtier" for t in ("memory", "disk", "redis")}
    assert {t: o for t, (_, _, o) in published("none").items()} == {t: None for t in ("memory", "disk", "redis")}


def test_an_unknown_ownership_mode_is_refused():
    from kvtier.base.errors import ConfigError
    from kvtier.integrations.vllm.config import ConnectorConfig

    with pytest.raises(ConfigError, match="event_ownership"):
        ConnectorConfig.from_extra({"chunk_size": 32, "event_ownership": "kvtier",
                                    "tiers": [{"kind": "memory", "capacity_bytes": "1MiB"}]})
    assert ConnectorConfig.from_extra({"chunk_size": 32, "tiers": [{"kind": "memory", "capacity_bytes": "1MiB"}]
                                       }).event_ownership == "shared"
