"""TierChain on its own: which tiers a write goes to, promotion, demotion, deletion of what fails verification,
failure counting, and the one event rule for chunks, segments and snapshots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier import KVSpec
from kvtier.base.errors import ConfigError
from kvtier.base.keys import ChunkHash
from kvtier.base.metrics import Metrics
from kvtier.codecs import BytesPayload
from kvtier.codecs.blob import decode_blob
from kvtier.core.cache import TensorSink, TensorSource
from kvtier.core.chain import TierChain
from kvtier.core.events import CacheEvents, ChunkEvent, ChunkEventKind, EntryKind
from kvtier.core.jobs import Entry, StoreJob
from kvtier.core.pipeline import Pipeline
from kvtier.tiers import MemoryTierConfig, TierContext, WriteMode
from tests.core.test_cache import BrokenTier

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.float16)
CHUNK = 8
CHUNK_BYTES = SPEC.bytes_per_token * CHUNK + 320  # payload and header


class GetFails(BrokenTier):
    """Says it holds everything, then fails to read it."""

    def contains(self, keys):
        return [True] * len(keys)


def memory(name: str, chunks: int = 64):
    return MemoryTierConfig(capacity_bytes=chunks * CHUNK_BYTES, prefault=False).build(
        TierContext(SPEC, Metrics(), name))


def make_chain(*tiers, modes=None) -> tuple[TierChain, list[ChunkEvent]]:
    metrics = Metrics()
    events = CacheEvents()
    seen: list[ChunkEvent] = []
    events.subscribe(seen.extend)
    modes = modes if modes is not None else [WriteMode.THROUGH] * len(tiers)
    chain = TierChain(list(tiers), modes, metrics, events, Pipeline(SPEC, CHUNK, metrics))
    return chain, seen


def key(n: int) -> ChunkHash:
    return ChunkHash(n.to_bytes(32, "big"))


def entry(n: int, tokens: int = CHUNK) -> Entry:
    ids = np.arange(n * 100, n * 100 + tokens, dtype=np.uint32)
    kv = torch.randn(SPEC.chunk_shape(tokens), generator=torch.Generator().manual_seed(n)).to(SPEC.dtype)
    return Entry(key(n), ids, kv)


def decode(tier, k, blob, tokens) -> torch.Tensor:
    return decode_blob(blob, k, tokens, codec=tier.codec, verify=tier.verifies).clone()


def stored(seen: list[ChunkEvent]) -> list[tuple]:
    return [(e.tier, e.key, e.entry, e.position) for e in seen if e.kind is ChunkEventKind.STORED]


@pytest.mark.parametrize("kind", [EntryKind.SEGMENT, EntryKind.SNAPSHOT])
def test_segments_and_snapshots_stored_are_one_event_per_entry_and_tier_with_their_kind(kind: EntryKind) -> None:
    chain, seen = make_chain(memory("fast"), memory("slow"))
    entries = [entry(1), entry(2, tokens=5)]
    assert [(tier.name, done) for tier, done in chain.store(entries, kind)] == [("fast", [0, 1]), ("slow", [0, 1])]
    assert stored(seen) == [(t, e.key, kind, None) for t in ("fast", "slow") for e in entries]
    seen.clear()
    assert [done for _, done in chain.store(entries, kind)] == [[], []]  # nothing missing: nothing written
    assert seen == []


@pytest.mark.parametrize("kind", list(EntryKind))
def test_an_entry_promoted_is_reported_with_its_kind_and_no_position(kind: EntryKind) -> None:
    chain, seen = make_chain(memory("fast"), memory("slow"))
    entries = [entry(1), entry(2)]
    chain.promote(1, entries, kind)
    assert stored(seen) == [("fast", e.key, kind, None) for e in entries]
    assert chain.metrics.get("kvtier_promotions_total", tier="fast") == 2
    assert chain.tiers[0].contains([e.key for e in entries]) == [True, True]


def test_chunks_a_request_stores_carry_their_chain_position_parent_and_tokens() -> None:
    chain, seen = make_chain(memory("fast"))
    kv = torch.randn(SPEC.chunk_shape(3 * CHUNK)).to(SPEC.dtype)
    keys = [key(i) for i in range(3)]
    token_ids = np.arange(3 * CHUNK, dtype=np.uint32)
    assert chain.store_chunks(StoreJob(keys, token_ids, TensorSource(kv))) == [True] * 3
    assert [(e.key, e.position, e.parent, e.entry) for e in seen] == [
        (keys[i], i, keys[i - 1] if i else None, EntryKind.CHUNK) for i in range(3)]
    assert np.frombuffer(seen[1].tokens, "<u4").tolist() == token_ids[CHUNK : 2 * CHUNK].tolist()
    seen.clear()
    assert chain.store_chunks(StoreJob(keys, token_ids, TensorSource(kv))) == [False] * 3  # nothing missing
    assert seen == []


def test_a_store_goes_to_the_first_and_write_through_tiers_and_write_back_ones_get_evictions() -> None:
    """A write-back tier is fed by the evictions of the tier right above it. The mode may be given by its value
    ("back"), as keyword configs do."""
    chain, seen = make_chain(memory("fast"), memory("through", chunks=2), memory("back"),
                             modes=[WriteMode.THROUGH, WriteMode.THROUGH, "back"])
    assert chain.writers == (0, 1)
    entries = [entry(n) for n in range(4)]
    assert [tier.name for tier, _ in chain.store(entries[:1], EntryKind.SEGMENT)] == ["fast", "through"]
    assert chain.tiers[2].contains([entries[0].key]) == [False]
    chain.store(entries[1:], EntryKind.SEGMENT)  # the tier above holds two: the first ones are evicted
    demoted = [e.key for e in entries if chain.tiers[2].contains([e.key])[0]]
    assert demoted and chain.metrics.get("kvtier_demotions_total", tier="back") == len(demoted)
    assert [(t, k, kind) for t, k, kind, _ in stored(seen) if t == "back"] == [("back", k, None) for k in demoted]
    found = chain.read({k: entries[int.from_bytes(k, "big")].tokens for k in demoted}, decode, EntryKind.SEGMENT)
    assert all(torch.equal(found[k][0], entries[int.from_bytes(k, "big")].tensor) for k in demoted)


def test_a_write_back_tier_needs_a_tier_above_that_reports_evictions() -> None:
    with pytest.raises(ConfigError, match="reports no evictions"):
        make_chain(BrokenTier(), memory("back"), modes=[WriteMode.THROUGH, WriteMode.BACK])


def test_a_hit_below_is_promoted_and_a_corrupt_copy_is_deleted_and_looked_for_below() -> None:
    chain, seen = make_chain(memory("fast"), memory("slow"))
    good, bad = entry(1), entry(2)
    chain.store([good, bad], EntryKind.SNAPSHOT)
    with chain.tiers[0].get([bad.key]) as (view,):
        blob = bytearray(view)
    blob[40 + 4 * 5] ^= 0xFF  # a token id in the header: this copy no longer verifies
    chain.tiers[0].delete([bad.key, good.key])
    chain.tiers[0].put([(bad.key, BytesPayload(blob))])
    found = chain.read({good.key: good.tokens, bad.key: bad.tokens}, decode, EntryKind.SNAPSHOT)
    assert {k: t for k, (_, t) in found.items()} == {good.key: 1, bad.key: 1}  # both from the slow tier
    assert torch.equal(found[bad.key][0], bad.tensor)
    assert chain.metrics.get("kvtier_corrupt_chunks_total", tier="fast") == 1
    assert chain.tiers[0].contains([good.key, bad.key]) == [True, True]  # the bad copy deleted, both promoted
    assert chain.metrics.get("kvtier_promotions_total", tier="fast") == 2
    removed = [e.key for e in seen if e.kind is ChunkEventKind.REMOVED]
    assert bad.key in removed


def test_a_corrupt_chunk_loaded_through_the_pipeline_is_a_counted_miss_and_deleted() -> None:
    chain, _ = make_chain(memory("fast"))
    kv = torch.randn(SPEC.chunk_shape(2 * CHUNK)).to(SPEC.dtype)
    keys, token_ids = [key(7), key(8)], np.arange(2 * CHUNK, dtype=np.uint32)
    chain.store_chunks(StoreJob(keys, token_ids, TensorSource(kv)))
    wrong = token_ids.copy()
    wrong[CHUNK] += 1  # the second chunk's blob records other token ids than the request's
    out = torch.zeros_like(kv)
    assert chain.load_chunks(keys, [0, 0], wrong, TensorSink(out)) == [True, False]
    assert torch.equal(out[:, :, :CHUNK], kv[:, :, :CHUNK])
    assert chain.metrics.get("kvtier_corrupt_chunks_total", tier="fast") == 1
    assert chain.locate(keys) == [0, None]


def test_failures_are_counted_under_their_operation_and_become_misses() -> None:
    chain, _ = make_chain(memory("fast"), BrokenTier())
    e = entry(3)
    assert chain.locate([e.key, key(99)]) == [None, None]
    assert chain.metrics.get("kvtier_tier_errors_total", tier="broken", op="contains") == 1
    assert [(tier.name, done) for tier, done in chain.store([e], EntryKind.SEGMENT)] == [("fast", [0]),
                                                                                         ("broken", [])]
    assert chain.metrics.get("kvtier_tier_errors_total", tier="broken", op="put") == 1
    chain.tiers[0].delete([e.key])
    assert chain.read({e.key: e.tokens}, decode, EntryKind.SEGMENT) == {}
    assert chain.metrics.get("kvtier_tier_errors_total", tier="broken", op="contains") == 2

    reads, _ = make_chain(GetFails("flaky"))
    assert reads.read({e.key: e.tokens}, decode, EntryKind.SEGMENT) == {}
    assert reads.metrics.get("kvtier_tier_errors_total", tier="flaky", op="get") == 1
    out = torch.zeros(SPEC.chunk_shape(CHUNK), dtype=SPEC.dtype)
    assert reads.load_chunks([e.key], [0], e.tokens, TensorSink(out)) == [False]
    assert reads.metrics.get("kvtier_tier_errors_total", tier="flaky", op="get") == 2


def test_a_promotion_into_a_failing_tier_is_counted_and_stores_nothing() -> None:
    chain, seen = make_chain(BrokenTier(), memory("slow"))
    chain.promote(1, [entry(4), entry(5)], EntryKind.SEGMENT)
    assert chain.metrics.get("kvtier_tier_errors_total", tier="broken", op="promote") == 1
    assert chain.metrics.total("kvtier_promotions_total") == 0 and seen == []
