"""The router's index: precise holdings from snapshots and batches, shared stores, its own record with a TTL."""

from __future__ import annotations

import hashlib

from kvtier.base.keys import ChunkHash
from kvtier.events.wire import Batch, Snapshot, WireEvent, WireTier
from kvtier.fleet.index import RECENT, FleetIndex


def key(i: int) -> ChunkHash:
    return ChunkHash(hashlib.sha256(b"index-%d" % i).digest())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def snapshot(epoch: str, **tiers: list[int] | str) -> Snapshot:
    out = []
    for name, keys in tiers.items():
        if isinstance(keys, str):  # a shared store: its id
            out.append(WireTier(name, None, keys))
        else:
            out.append(WireTier(name, [key(i) for i in keys]))
    return Snapshot(epoch, 0, out)


def test_a_replica_holds_the_longest_prefix_each_chunk_in_its_fastest_tier():
    index = FleetIndex()
    held = index.holdings("a")
    held.reset(snapshot("e1", memory=[0, 1], disk=[1, 2, 3]))
    keys = [key(i) for i in range(6)]
    assert index.cached("a", keys) == {"memory": 2, "disk": 2}  # chunk 1 counts once, in memory
    held.apply(Batch("e1", 1, 0.0, [WireEvent(False, "disk", key(2)), WireEvent(True, "memory", key(2), 2)]))
    assert index.cached("a", keys) == {"memory": 3, "disk": 1}
    held.apply(Batch("e1", 2, 0.0, [WireEvent(False, "memory", key(1))]))
    assert index.cached("a", keys) == {"memory": 2, "disk": 2}  # chunk 1 is still on disk
    held.apply(Batch("e1", 3, 0.0, [WireEvent(False, "disk", key(1))]))
    assert index.cached("a", keys) == {"memory": 1}  # a hole ends the prefix
    assert index.chunks("a") == {"memory": 2, "disk": 1}


def test_a_chunk_in_a_shared_store_counts_for_every_replica_reading_it():
    index = FleetIndex()
    index.holdings("a").reset(snapshot("ea", memory=[], redis="redis:h:6379/0#kvtier:raw:"))
    index.holdings("b").reset(snapshot("eb", memory=[], redis="redis:h:6379/0#kvtier:raw:"))
    index.holdings("c").reset(snapshot("ec", memory=[], redis="redis:other:6379/0#kvtier:raw:"))
    index.holdings("a").apply(Batch("ea", 1, 0.0, [WireEvent(True, "redis", key(0), 0),
                                                   WireEvent(True, "memory", key(0), 0)]))
    assert index.cached("a", [key(0)]) == {"memory": 1}
    assert index.cached("b", [key(0)]) == {"redis": 1}
    assert index.cached("c", [key(0)]) == {}


def test_the_routers_own_record_expires_and_is_dropped_when_its_replica_restarts():
    clock = Clock()
    index = FleetIndex(recent_ttl_s=100.0, in_flight_ttl_s=5.0, clock=clock)
    keys = [key(i) for i in range(3)]
    index.record("quiet", keys)  # a replica that publishes nothing: trusted for recent_ttl_s
    assert index.cached("quiet", keys + [key(9)]) == {RECENT: 3}
    index.holdings("loud").reset(snapshot("e", memory=[0]))
    index.record("loud", keys)  # a replica with events: its record only bridges until they arrive
    assert index.cached("loud", keys) == {"memory": 1, RECENT: 2}
    clock.now = 10.0
    assert index.cached("loud", keys) == {"memory": 1}
    assert index.cached("quiet", keys) == {RECENT: 3}
    index.restarted("quiet")
    assert index.cached("quiet", keys) == {}
    index.record("quiet", keys[:1])
    clock.now = 200.0
    assert index.cached("quiet", keys) == {}


def test_a_replicas_keys_are_capped_first_learnt_stays_and_dropped_events_are_counted():
    """Issue 29 E-3: a hostile replica's stores beyond its cap are dropped, not kept."""
    index = FleetIndex(max_replica_keys=100, max_total_keys=1000)
    held = index.holdings("a")
    held.reset(snapshot("e", memory=list(range(60)), disk=list(range(60, 120))))
    assert index.chunks("a") == {"memory": 60, "disk": 40} and held.dropped == 20  # fastest tiers first
    held.apply(Batch("e", 1, 0.0, [WireEvent(True, "memory", key(i), 0) for i in range(1000, 1100)]))
    assert sum(index.chunks("a").values()) == 100 and held.dropped == 120
    held.apply(Batch("e", 2, 0.0, [WireEvent(False, "memory", key(0)), WireEvent(True, "memory", key(2000), 0)]))
    assert index.cached("a", [key(2000)]) == {"memory": 1}  # a removal makes room again
    assert sum(index.chunks("a").values()) == 100


def test_tiers_are_those_the_snapshot_names_and_other_tier_names_are_dropped():
    index = FleetIndex()
    held = index.holdings("a")
    held.reset(snapshot("e", memory=[0]))
    held.apply(Batch("e", 1, 0.0, [WireEvent(True, f"tier-{i}", key(i), 0) for i in range(500)]))
    assert index.chunks("a") == {"memory": 1} and held.tiers == ["memory"] and held.dropped == 500


def test_the_total_cap_is_split_among_replicas_and_shared_stores_are_bounded():
    index = FleetIndex(max_keys=50, max_replica_keys=1000, max_total_keys=300, replicas=3)
    assert index.max_replica_keys == 100
    held = index.holdings("a")
    stores = {f"s{i}": f"redis:h{i}:6379/0#kvtier:raw:" for i in range(12)}  # more stores than the router keeps
    held.reset(snapshot("e", memory=[], **stores))
    assert len(held.tiers) == 1 + index.shared.max_stores
    held.apply(Batch("e", 1, 0.0, [WireEvent(True, "s0", key(i), 0) for i in range(200)]))
    assert index.chunks("a")["s0"] == 50  # a shared store keeps its newest keys, at most max_keys


def test_an_ejected_replica_is_forgotten():
    index = FleetIndex()
    index.holdings("a").reset(snapshot("e", memory=list(range(10))))
    index.record("a", [key(i) for i in range(20)])
    index.forget("a")
    assert index.chunks("a") == {} and index.cached("a", [key(0)]) == {}
