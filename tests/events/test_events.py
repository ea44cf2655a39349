"""The cache's event stream: what KVCache reports, over real ZMQ sockets into the router's index."""

from __future__ import annotations

import asyncio
import os

import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.threads import WATCHED
from kvtier.core.events import ChunkEvent, ChunkEventKind, holdings
from kvtier.events.publisher import EventPublisher, PublisherConfig
from kvtier.events.subscriber import EventSubscriber, SubscriberConfig
from kvtier.events.wire import (
    Batch,
    WireError,
    WireEvent,
    decode_batch,
    decode_batch_head,
    decode_events,
    decode_snapshot,
    encode_batch,
    namespace_from_json,
    namespace_json,
)
from kvtier.fleet.index import FleetIndex
from kvtier.tiers import DiskTierConfig, MemoryTierConfig, WriteMode

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 16
CHUNK_BYTES = SPEC.bytes_per_token * CHUNK + 320


def kv_for(n: int) -> torch.Tensor:
    return torch.randn(SPEC.chunk_shape(n), generator=torch.Generator().manual_seed(n)).to(SPEC.dtype)


def cache_with(*tiers) -> KVCache:
    return KVCache(SPEC, "events-model@1", CacheConfig(chunk_size=CHUNK, tiers=tiers))


def recorder(cache: KVCache) -> list[ChunkEvent]:
    seen: list[ChunkEvent] = []
    cache.events.subscribe(seen.extend)
    return seen


def test_stores_report_chain_positions_parents_and_tokens():
    cache = cache_with(MemoryTierConfig(capacity_bytes=16 * CHUNK_BYTES, prefault=False))
    seen = recorder(cache)
    tokens = list(range(100, 150))  # 3 full chunks
    cache.store(tokens, kv_for(50))
    keys = cache.keys(tokens)
    assert [(e.kind, e.tier, e.key, e.position) for e in seen] == [
        (ChunkEventKind.STORED, "memory", keys[i], i) for i in range(3)]
    assert [e.parent for e in seen] == [None, keys[0], keys[1]]
    assert np.frombuffer(seen[2].tokens, "<u4").tolist() == tokens[32:48]
    seen.clear()
    cache.store(tokens, kv_for(50))
    assert seen == []  # nothing new was stored
    cache.close()


def test_write_back_eviction_reports_the_move_and_disk_reports_its_own_evictions(tmp_path):
    cache = cache_with(MemoryTierConfig(capacity_bytes=2 * CHUNK_BYTES, prefault=False),
                       DiskTierConfig(path=tmp_path, capacity_bytes=3 * CHUNK_BYTES, write=WriteMode.BACK,
                                      o_direct=False, fsync=False, admission="always"))
    seen = recorder(cache)
    for n in range(7):  # seven one-chunk prompts through a 2-chunk memory tier and a 3-chunk disk
        cache.store(list(range(n * 100, n * 100 + CHUNK)), kv_for(CHUNK + n))
        cache.tiers[1].flush()
    state: dict[str, set[bytes]] = {"memory": set(), "disk": set()}
    for e in seen:
        (state[e.tier].add if e.kind is ChunkEventKind.STORED else state[e.tier].discard)(e.key)
    assert any(e.kind is ChunkEventKind.REMOVED and e.tier == "disk" for e in seen)  # the disk evicted too
    held = {h.name: set(h.keys) for h in holdings(cache.tiers)}
    assert state == held and len(held["memory"]) == 2 and len(held["disk"]) == 3
    cache.close()


def test_a_chunk_that_fails_verification_is_reported_removed(tmp_path):
    cache = cache_with(DiskTierConfig(path=tmp_path, capacity_bytes=8 * CHUNK_BYTES, o_direct=False))
    tokens = list(range(CHUNK))
    cache.store(tokens, kv_for(CHUNK))
    cache.tiers[0].flush()
    seen = recorder(cache)
    path = cache.tiers[0].paths.path(cache.keys(tokens)[0])
    with open(path, "r+b") as fh:  # flip a payload byte: the checksum fails on read
        fh.seek(os.path.getsize(path) - 1)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([last[0] ^ 0xFF]))
    assert cache.retrieve(tokens)[1] == 0
    assert [(e.kind, e.tier) for e in seen] == [(ChunkEventKind.REMOVED, "disk")]
    cache.close()


def test_a_batch_decodes_in_slices_to_exactly_its_events_and_a_bad_event_fails_its_slice():
    events = [WireEvent(i % 3 != 0, f"tier-{i % 7}", bytes([i % 256]) * 32, i if i % 2 else None)
              for i in range(5_000)]
    head = decode_batch_head(encode_batch(Batch("epoch-1", 9, 1.5, events)))
    assert (head.epoch, head.seq, head.ts, len(head.events)) == ("epoch-1", 9, 1.5, 5_000)
    sliced = [e for start in range(0, 5_000, 2_048) for e in decode_events(head.events[start: start + 2_048])]
    assert sliced == events
    bad = msgspec.msgpack.encode(["e", 0, 0.0, [[True, "memory", b"k" * 32, 0], [True, "memory", b"short", 0]]])
    head = decode_batch_head(bad)  # the structure is fine: the bad key is found by the slice that holds it
    assert decode_events(head.events[:1])[0].tier == "memory"
    with pytest.raises(WireError):
        decode_events(head.events[1:])
    with pytest.raises(WireError):
        decode_batch_head(b"\x93\x01\x02")


def test_wire_rejects_what_is_not_a_message():
    with pytest.raises(WireError):
        decode_batch(b"\x93\x01\x02")
    with pytest.raises(WireError):  # a key of the wrong length
        decode_batch(msgspec.msgpack.encode(["e", 0, 0.0, [[True, "memory", b"short", 0]]]))
    with pytest.raises(WireError):
        decode_snapshot(b"\xc1")
    with pytest.raises(WireError):
        namespace_from_json({"model": "m", "layers": 0})
    cache = cache_with(MemoryTierConfig(capacity_bytes=CHUNK_BYTES, prefault=False))
    assert namespace_from_json(namespace_json(cache.namespace)) == cache.namespace
    cache.close()


class IndexSink:
    """A subscriber's sink that feeds replica ``r``'s holdings in a FleetIndex (as the router does)."""

    def __init__(self, index: FleetIndex) -> None:
        self.held = index.holdings("r")

    def prepare(self, snapshot):
        return self.held.prepare(snapshot)

    def reset(self, prepared) -> None:
        self.held.reset(prepared)

    def apply(self, batch) -> None:
        self.held.apply(batch)


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def _matches(index: FleetIndex, cache: KVCache) -> bool:
    held = index.holdings("r")
    return held.synced and all(
        {k for k in h.keys} == {k for k in held._local.get(h.name, ())} for h in holdings(cache.tiers))


def test_subscriber_follows_stores_evictions_gaps_and_a_restart(tmp_path):
    config = PublisherConfig(heartbeat_s=0.1, batch_interval_s=0.005, max_queue=64)

    def start(cache: KVCache) -> EventPublisher:
        return EventPublisher(cache.events.subscribe, lambda: holdings(cache.tiers), config)

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        index = FleetIndex()
        counts: dict[str, int] = {}
        cache = cache_with(MemoryTierConfig(capacity_bytes=6 * CHUNK_BYTES, prefault=False),
                           DiskTierConfig(path=tmp_path, capacity_bytes=64 * CHUNK_BYTES, o_direct=False,
                                          fsync=False, admission="always"))
        cache.store(list(range(3 * CHUNK)), kv_for(3 * CHUNK))  # before anyone listens: only in the snapshot
        cache.tiers[1].flush()
        pub = start(cache)
        sub = EventSubscriber(ctx, pub.endpoint, pub.control_endpoint, pub.public_key, IndexSink(index),
                              SubscriberConfig(),
                              lambda what: counts.__setitem__(what, counts.get(what, 0) + 1))
        task = asyncio.ensure_future(sub.run())
        try:
            await _until(lambda: _matches(index, cache))
            for n in range(8):  # evictions from memory, stores to both tiers
                cache.store(list(range(1000 * n, 1000 * n + 2 * CHUNK)), kv_for(2 * CHUNK + n))
            cache.tiers[1].flush()
            await _until(lambda: _matches(index, cache) and counts.get("batch", 0) > 0)
            keys = cache.keys(list(range(7000, 7000 + 2 * CHUNK)))
            assert index.cached("r", keys) == {"memory": 2}
            snapshots = counts["snapshot"]
            cache.store(list(range(50_000, 50_000 + 70 * CHUNK)), kv_for(70 * CHUNK))  # 70 events > 64 queued:
            cache.tiers[1].flush()  # dropped, and the stream skips a number
            await _until(lambda: counts.get("gap", 0) >= 1 and _matches(index, cache))
            assert counts["snapshot"] > snapshots
            pub.close()
            cache.close()
            # the replica restarts on the same disk: warm, with a new epoch; the router's index follows
            cache = cache_with(MemoryTierConfig(capacity_bytes=6 * CHUNK_BYTES, prefault=False),
                               DiskTierConfig(path=tmp_path, capacity_bytes=64 * CHUNK_BYTES, o_direct=False,
                                              admission="always"))
            pub = start(cache)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sub = EventSubscriber(ctx, pub.endpoint, pub.control_endpoint, pub.public_key, IndexSink(index),
                                  SubscriberConfig(), lambda what: None)
            task = asyncio.ensure_future(sub.run())
            await _until(lambda: sub.epoch == pub.epoch and _matches(index, cache))
            assert index.cached("r", keys) == {"disk": 2}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close()
            cache.close()
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_a_failed_publisher_turn_or_sink_batch_is_a_gap_and_both_threads_go_on(tmp_path):
    """A publisher turn that raises (injected into its send) and a sink that chokes on one batch: the thread and
    the task survive, the subscriber resynchronises from a snapshot, and the index follows the cache again."""
    config = PublisherConfig(heartbeat_s=0.1, batch_interval_s=0.005, max_queue=64)

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        index = FleetIndex()
        counts: dict[str, int] = {}
        cache = cache_with(MemoryTierConfig(capacity_bytes=16 * CHUNK_BYTES, prefault=False))
        pub = EventPublisher(cache.events.subscribe, lambda: holdings(cache.tiers), config)
        sink = IndexSink(index)
        apply, send = sink.apply, pub._send
        faults = {"send": 0, "apply": 0}

        def send_fails_once(events, skip):
            if events and not faults["send"]:
                faults["send"] += 1
                raise RuntimeError("injected: one publisher turn fails")
            send(events, skip)

        def apply_fails_once(batch):
            if batch.events and not faults["apply"]:
                faults["apply"] += 1
                raise RuntimeError("injected: the sink chokes on one batch")
            apply(batch)

        pub._send, sink.apply = send_fails_once, apply_fails_once
        sub = EventSubscriber(ctx, pub.endpoint, pub.control_endpoint, pub.public_key, sink, SubscriberConfig(),
                              lambda what: counts.__setitem__(what, counts.get(what, 0) + 1))
        task = asyncio.ensure_future(sub.run())
        try:
            await _until(lambda: _matches(index, cache))
            for n in range(4):
                cache.store(list(range(1000 * n, 1000 * n + 2 * CHUNK)), kv_for(2 * CHUNK + n))
                await _until(lambda: _matches(index, cache))
            assert faults == {"send": 1, "apply": 1} and pub.counts.get("errors") == 1
            assert counts.get("apply_failed") == 1 and counts.get("gap", 0) >= 1 and counts["snapshot"] >= 2
            assert pub._thread.is_alive() and not task.done()
            assert "kvtier-events" not in WATCHED.dead()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close()
            cache.close()
            ctx.destroy(linger=0)

    asyncio.run(scenario())
