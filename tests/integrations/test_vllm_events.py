"""kvtier's tier events as vLLM KV events: chains joined, removals per tier, the scheduler's hand-over."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.integrations.vllm.events import KVTierKVEvents, SchedulerEvents, TierEvents  # noqa: E402
from kvtier.tiers import MemoryTierConfig  # noqa: E402

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
CHUNK = 16


def test_a_stored_chain_is_one_block_stored_and_evictions_are_block_removed():
    chunk_bytes = SPEC.bytes_per_token * CHUNK + 320
    cache = KVCache(SPEC, "m@1", CacheConfig(chunk_size=CHUNK, tiers=(
        MemoryTierConfig(capacity_bytes=4 * chunk_bytes, prefault=False),)))
    events = TierEvents(cache)
    tokens = list(range(3 * CHUNK))
    cache.store(tokens, torch.zeros(SPEC.chunk_shape(3 * CHUNK), dtype=SPEC.dtype))
    taken = events.take()
    assert isinstance(taken, KVTierKVEvents)
    (stored,) = taken.get_all_events()
    keys = [bytes(k) for k in cache.keys(tokens)]
    assert isinstance(stored, BlockStored) and stored.medium == "CPU" and stored.ownership is None
    assert stored.block_hashes == keys and stored.parent_block_hash is None
    assert stored.token_ids == tokens and stored.block_size == CHUNK
    other = list(range(1000, 1000 + 2 * CHUNK))  # 5 chunks in a 4-chunk tier: one of the first chain goes
    cache.store(other, torch.zeros(SPEC.chunk_shape(2 * CHUNK), dtype=SPEC.dtype))
    removed = [e for e in events.take().get_all_events() if isinstance(e, BlockRemoved)]
    held = cache.tiers[0].contains(cache.keys(tokens))
    gone = [key for key, kept in zip(keys, held) if not kept]  # whichever the tier's policy chose
    assert len(gone) == 1 and [e.block_hashes for e in removed] == [gone] and removed[0].medium == "CPU"
    assert events.take() is None
    events.close()
    cache.close()


def test_the_scheduler_side_hands_each_event_over_once():
    scheduler = SchedulerEvents()
    event = BlockRemoved(block_hashes=[b"k" * 32], medium="disk")
    scheduler.add(KVTierKVEvents([event]))
    scheduler.add(None)
    assert list(scheduler.take()) == [event]
    assert list(scheduler.take()) == []


def test_segment_and_snapshot_stores_are_not_reported_as_blocks():
    from kvtier.core.events import ChunkEvent, ChunkEventKind, EntryKind
    from kvtier.integrations.vllm.events import to_vllm

    key = bytes(range(32))
    tokens = np.arange(CHUNK, dtype="<u4").tobytes()
    stored = [ChunkEvent(ChunkEventKind.STORED, "disk", key, 0, None, tokens, entry)
              for entry in (EntryKind.SEGMENT, EntryKind.SNAPSHOT)]
    assert to_vllm(stored, CHUNK) == []  # not prefix blocks: a router must not match prompts against them
    chunk = ChunkEvent(ChunkEventKind.STORED, "disk", key, 0, None, tokens, EntryKind.CHUNK)
    demoted = ChunkEvent(ChunkEventKind.STORED, "redis", key, None, None, tokens, None)
    removed = ChunkEvent(ChunkEventKind.REMOVED, "memory", key)
    out = to_vllm([*stored, chunk, demoted, removed], CHUNK)
    assert [type(e) for e in out] == [BlockStored, BlockStored, BlockRemoved]
    assert [e.medium for e in out] == ["DISK", "REDIS", "CPU"]  # the default media (EventMedia)


def test_media_are_configurable_per_tier_and_never_shared_between_tiers():
    from kvtier.base.errors import ConfigError
    from kvtier.core.events import ChunkEvent, ChunkEventKind
    from kvtier.integrations.vllm.events import EventMedia, to_vllm

    key = bytes(range(32))
    media = EventMedia({"disk": "NVME"}, frozenset({"redis"}))
    out = to_vllm([ChunkEvent(ChunkEventKind.REMOVED, tier, key) for tier in ("memory", "disk", "redis")], CHUNK,
                  media)
    assert [(e.medium, e.locality) for e in out] == [("CPU", "LOCAL"), ("NVME", "LOCAL"), ("SHARED", "REMOTE")]
    with pytest.raises(ConfigError):
        EventMedia({"disk": "CPU"}).check(["memory", "disk"])  # a removal from one would remove from both
    with pytest.raises(ConfigError):
        EventMedia({"memory": "GPU"}).check(["memory"])  # vLLM's own device cache
