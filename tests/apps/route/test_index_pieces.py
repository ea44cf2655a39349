"""Issue 29, E-3: what a replica's snapshot costs the router comes in bounded pieces.

A hostile replica's 2.5 M-key snapshot was decoded in one call (~180 ms holding the GIL) and the 2 M keys it
replaced, or that an ejection forgot, were freed in one go on the event loop (~0.1 s). These count the pieces:
keys decoded per call, and shards freed per event-loop turn, never time.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import sys

import msgspec
import pytest

from kvtier.core.events import TierHolding
from kvtier.events import wire
from kvtier.events.subscriber import EventSubscriber, Pacer, SubscriberConfig
from kvtier.events.wire import (
    KEYS_PIECE,
    Batch,
    SnapshotHead,
    WireError,
    WireEvent,
    decode_snapshot_head,
    encode_snapshot,
)
from kvtier.fleet.index import SHARD_KEYS, FleetIndex

N = 5 * KEYS_PIECE + 123


def keys(n: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + b"%d" % i).digest() for i in range(n)]


def payload(tiers: list[TierHolding]) -> bytes:
    return encode_snapshot("epoch", 7, tiers)


def test_a_snapshots_keys_are_decoded_in_pieces_of_at_most_keys_piece(monkeypatch):
    decoded: list[int] = []
    real = wire._keys_decoder

    class Counting:
        def decode(self, data):
            out = real.decode(data)
            decoded.append(len(out))
            return out

    monkeypatch.setattr(wire, "_keys_decoder", Counting())
    all_keys = keys(N)
    head = decode_snapshot_head(payload([TierHolding("memory", all_keys), TierHolding("disk", None)]))
    assert isinstance(head.tiers[0].keys, msgspec.Raw) and not decoded  # the structure alone: no key decoded
    index = FleetIndex(max_replica_keys=N - 100, replicas=1)
    held = index.holdings("r")
    held.reset(held.prepare(head))
    assert decoded and max(decoded) <= KEYS_PIECE and sum(decoded) == N - 100  # none past the cap decoded
    assert held.chunks() == {"memory": N - 100, "disk": 0} and held.dropped == 100
    assert index.cached("r", all_keys[:3]) == {"memory": 3}


@pytest.mark.parametrize("corrupt", [
    lambda raw: raw.replace(b"\xc4\x20", b"\xc4\x1f", 1),  # a 31-byte key: records no longer line up
    lambda raw: raw[:-1],  # cut short
    lambda raw: raw.replace(b"\xc4\x20", b"\xc5\x00\x20", 1),  # a key as bin 16: valid msgpack, not our records
])
def test_malformed_raw_keys_are_a_wire_error(corrupt):
    good = payload([TierHolding("memory", keys(40))])
    with pytest.raises(WireError):
        head = decode_snapshot_head(corrupt(good))
        FleetIndex().holdings("r").prepare(head)


def test_the_subscriber_hands_its_sink_undecoded_keys():
    class Sink:
        def prepare(self, snapshot):
            return snapshot

    subscriber = EventSubscriber(None, "tcp://x", "tcp://y", b"k" * 40, Sink(), client_key=(b"p" * 40, b"s" * 40))
    head, prepared = subscriber._prepare(payload([TierHolding("memory", keys(3))]))
    assert isinstance(prepared, SnapshotHead) and isinstance(prepared.tiers[0].keys, msgspec.Raw)
    assert (head.epoch, head.seq) == ("epoch", 7)


def held_elsewhere(shards: list[dict]) -> int:
    """How many of ``shards`` something besides this list still holds (the index, or its queue of frees)."""
    alone = next(sys.getrefcount(s) for s in [{}])  # the list's, the loop variable's and the call's references
    return sum(sys.getrefcount(s) > alone for s in shards)


def test_a_replicas_keys_are_never_tracked_by_the_cyclic_garbage_collector():
    index = FleetIndex(max_replica_keys=4 * SHARD_KEYS, replicas=1)
    held = index.holdings("r")
    held.reset(decode_snapshot_head(payload([TierHolding("memory", keys(4 * SHARD_KEYS))])))
    held.apply(Batch("epoch", 8, 0.0, [WireEvent(True, "memory", bytes(32), 1)]))
    # a full collection visits every key of a tracked container: seconds of a stopped loop at the cap
    assert not any(gc.is_tracked(shard) for shard in held._local["memory"].shards)


def test_keys_replaced_or_forgotten_are_freed_one_shard_per_loop_turn():
    cap = 8 * SHARD_KEYS

    async def main() -> list[list[int]]:
        index = FleetIndex(max_replica_keys=cap, replicas=1)
        held = index.holdings("r")
        held.reset(decode_snapshot_head(payload([TierHolding("memory", keys(cap))])))
        alive: list[list[int]] = []
        for replace in (True, False):
            shards = list(held._local["memory"].shards)
            assert len(shards) >= 8 and max(len(s) for s in shards) < 2 * SHARD_KEYS
            if replace:
                held.reset(decode_snapshot_head(payload([TierHolding("memory", keys(cap, b"new"))])))
            else:
                index.forget("r")
            counts = [held_elsewhere(shards)]
            while counts[-1]:
                await asyncio.sleep(0)
                counts.append(held_elsewhere(shards))
                assert len(counts) < 100
            alive.append(counts)
            held = index.holdings("r")
            held.reset(decode_snapshot_head(payload([TierHolding("memory", keys(cap, b"again"))])))
        return alive

    for counts in asyncio.run(main()):
        assert counts[0] == len(counts) - 1 >= 8  # nothing freed in the call itself, then one shard a turn
        assert all(a - b == 1 for a, b in zip(counts, counts[1:]))


def test_without_a_running_loop_keys_are_freed_at_once():
    index = FleetIndex(max_replica_keys=4 * SHARD_KEYS, replicas=1)
    held = index.holdings("r")
    held.reset(decode_snapshot_head(payload([TierHolding("memory", keys(4 * SHARD_KEYS))])))
    shards = list(held._local["memory"].shards)
    index.forget("r")
    assert held_elsewhere(shards) == 0


def test_a_snapshots_shared_store_keys_are_added_a_piece_per_loop_turn():
    shared = keys(3 * KEYS_PIECE + 5)

    async def main() -> list[int]:
        index = FleetIndex(max_keys=len(shared))
        held = index.holdings("r")
        held.reset(decode_snapshot_head(payload([TierHolding("redis", shared, "store-1")])))
        store = index.shared.store("store-1")
        sizes = [len(store)]
        while sizes[-1] < len(shared):
            await asyncio.sleep(0)
            sizes.append(len(store))
            assert len(sizes) < 20
        assert index.cached("r", shared[:2]) == {"redis": 2}
        return sizes

    sizes = asyncio.run(main())
    assert sizes[0] == 0 and len(sizes) == 5 and all(0 < b - a <= KEYS_PIECE for a, b in zip(sizes, sizes[1:]))


def test_the_pacer_sleeps_for_its_share_after_each_slice_of_work_and_yields_otherwise():
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def main() -> None:
        pacer = Pacer(share=0.25, slice_s=0.005, sleep=sleep)
        for _ in range(4):
            await pacer.spent(0.002)  # a batch's CPU: 2 ms
        await pacer.spent(0.0001)

    asyncio.run(main())
    # 2, 4 ms: a turn each; 6 ms: a slice, then 3x its length asleep (a quarter of the time working); 2 ms; 2.1 ms
    assert slept == [0, 0, pytest.approx(0.018), 0, 0]


def test_a_subscriber_paces_batches_with_its_configured_share():
    subscriber = EventSubscriber(None, "tcp://x", "tcp://y", b"k" * 40, None, SubscriberConfig(share=0.3),
                                 client_key=(b"p" * 40, b"s" * 40))
    assert subscriber._pacer.share == 0.3


def test_a_big_batch_is_applied_a_bounded_number_of_events_per_loop_turn_and_whole():
    """The subscriber applies a 10,000-event batch 1,000 events at a time, another task running between the
    slices; the whole batch reaches the holdings in order, and ``seq`` moves on only after its last slice."""
    index = FleetIndex(replicas=1)
    holdings = index.holdings("r")
    holdings.reset(decode_snapshot_head(encode_snapshot("e", 0, [TierHolding("memory", [])])))
    keys = [hashlib.sha256(b"%d" % i).digest() for i in range(10_000)]
    batch = wire.Batch("e", 1, 0.0, [wire.WireEvent(True, "memory", k, 0) for k in keys])
    sizes: list[int] = []
    applied = holdings.apply

    def apply(piece: wire.Batch) -> None:
        sizes.append(len(piece.events))
        applied(piece)

    holdings.apply = apply  # type: ignore[method-assign]
    subscriber = EventSubscriber(None, "tcp://x", "tcp://y", b"k" * 40, holdings,
                                 SubscriberConfig(keys_per_turn=1_000), client_key=(b"p" * 40, b"s" * 40))
    subscriber.epoch, subscriber.seq = "e", 0
    turns: list[tuple[int, int]] = []

    async def main() -> None:
        async def tick() -> None:
            while True:
                turns.append((len(sizes), subscriber.seq))
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await subscriber._apply(subscriber._receive([wire.TOPIC, b"\0" * 8, wire.encode_batch(batch)]), 0.0)
        ticker.cancel()

    asyncio.run(main())
    assert sizes == [1_000] * 10
    assert {n for n, _ in turns} >= set(range(1, 10))  # the other task ran after every slice but the last
    assert all(seq == 0 for n, seq in turns if n < 10)
    assert subscriber.seq == 1 and index.cached("r", keys) == {"memory": 10_000}
