"""The segment cache: whole segments of KV under segment keys, through the KVCache's tiers."""

from __future__ import annotations

import pytest
import torch

from kvtier import CacheConfig, KVCache
from kvtier.base.errors import ConfigError
from kvtier.core.events import ChunkEventKind, EntryKind
from kvtier.core.segments import SegmentCache
from kvtier.tiers import MemoryTierConfig
from tests.core.test_cache import CHUNK, CHUNK_BYTES, SPEC, BrokenTierConfig, kv_for

SEGMENT = list(range(100, 140))  # 40 tokens: more than two chunks, not a multiple of one
SHORT = [7, 8, 9]  # shorter than a chunk


def segments(*tiers) -> SegmentCache:
    tiers = tiers or (MemoryTierConfig(capacity_bytes=64 * CHUNK_BYTES),)
    return SegmentCache(KVCache(SPEC, "test-model@1", CacheConfig(chunk_size=CHUNK, tiers=tiers)))


def test_store_and_retrieve_whole_segments_of_any_length():
    seg = segments()
    kv, short = kv_for(40, 1), kv_for(3, 2)
    assert seg.retrieve([SEGMENT, SHORT]) == [None, None]
    assert seg.store(SEGMENT, kv) and seg.store(SHORT, short)
    assert not seg.store(SEGMENT, kv)  # already held
    got = seg.retrieve([SHORT, SEGMENT, SHORT])
    assert torch.equal(got[0], short) and torch.equal(got[1], kv) and torch.equal(got[2], short)
    got[1].zero_()  # a copy: the stored segment is untouched
    assert torch.equal(seg.retrieve([SEGMENT])[0], kv)
    metrics = seg.cache.metrics
    assert metrics.get("kvtier_segment_hit_tokens_total", tier="memory") == 3 + 40 + 40
    assert metrics.get("kvtier_segment_stored_tokens_total", tier="memory") == 43
    assert seg.contains([SEGMENT, [1, 2]]) == [True, False]


def test_segments_never_answer_prefix_lookups_nor_the_reverse():
    seg = segments()
    tokens = SEGMENT[:32]
    seg.store(tokens, kv_for(32))
    assert seg.cache.lookup(tokens + [0]) == 0
    seg.cache.store(SEGMENT[16:], kv_for(24))  # one whole chunk, SEGMENT[16:32]
    assert seg.cache.lookup(SEGMENT[16:]) == 16
    assert seg.contains([SEGMENT[16:32]]) == [False]


def test_tenants_and_base_positions_do_not_share_segments():
    seg = segments()
    seg.store(SEGMENT, kv_for(40), salt=b"alice")
    assert seg.retrieve([SEGMENT], salt=b"bob") == [None]
    assert seg.retrieve([SEGMENT]) == [None]
    assert seg.retrieve([SEGMENT], salt=b"alice")[0] is not None
    other = SegmentCache(seg.cache, base_position=5)
    assert other.retrieve([SEGMENT], salt=b"alice") == [None]


def test_a_tampered_segment_is_a_counted_miss_and_is_deleted():
    seg = segments()
    seg.store(SEGMENT, kv_for(40))
    tier = seg.cache.tiers[0]
    with tier.get([seg.key(SEGMENT)]) as (view,):
        view[40 + 4 * 5 + 8] ^= 0xFF  # a token id in the header
    assert seg.retrieve([SEGMENT]) == [None]
    assert seg.cache.metrics.get("kvtier_corrupt_chunks_total", tier="memory") == 1
    assert seg.contains([SEGMENT]) == [False]


def test_a_hit_in_a_slower_tier_is_promoted():
    fast, slow = MemoryTierConfig(capacity_bytes=64 * CHUNK_BYTES), MemoryTierConfig(capacity_bytes=64 * CHUNK_BYTES)
    seg = segments(fast, slow)
    kv = kv_for(40)
    seg.store(SEGMENT, kv)  # write-through: both tiers
    seg.cache.tiers[0].delete([seg.key(SEGMENT)])
    assert torch.equal(seg.retrieve([SEGMENT])[0], kv)
    assert seg.cache.metrics.get("kvtier_segment_hit_tokens_total", tier="memory2") == 40
    assert seg.cache.tiers[0].contains([seg.key(SEGMENT)]) == [True]


def test_a_failing_tier_is_a_miss_or_a_skipped_store():
    seg = segments(BrokenTierConfig())
    assert not seg.store(SEGMENT, kv_for(40))
    assert seg.retrieve([SEGMENT]) == [None]
    assert seg.contains([SEGMENT]) == [False]
    assert seg.cache.metrics.total("kvtier_tier_errors_total") == 3


def test_store_checks_the_kv_against_the_spec_and_the_tokens():
    seg = segments()
    with pytest.raises(ConfigError):
        seg.store(SEGMENT, kv_for(39))
    with pytest.raises(ConfigError):
        SegmentCache(seg.cache, base_position=-1)


def test_segments_enter_the_event_stream_as_segments_not_chunks():
    """Stores and promotions of a segment are STORED events of kind SEGMENT, with no chain position."""
    fast, slow = MemoryTierConfig(capacity_bytes=64 * CHUNK_BYTES), MemoryTierConfig(capacity_bytes=64 * CHUNK_BYTES)
    seg = segments(fast, slow)
    seen = []
    seg.cache.events.subscribe(seen.extend)
    seg.store(SEGMENT, kv_for(40))
    key = seg.key(SEGMENT)
    assert [(e.kind, e.tier, e.key, e.entry, e.position) for e in seen] == [
        (ChunkEventKind.STORED, tier, key, EntryKind.SEGMENT, None) for tier in ("memory", "memory2")]
    seg.cache.tiers[0].delete([key])
    seen.clear()
    assert seg.retrieve([SEGMENT])[0] is not None
    assert [(e.kind, e.tier, e.entry) for e in seen] == [(ChunkEventKind.STORED, "memory", EntryKind.SEGMENT)]
