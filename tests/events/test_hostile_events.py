"""Issue 29, E-1/E-2/E-4: hostile processes against a replica's event sockets and a router's subscriber.

Each hostile peer is a process of its own speaking the real wire format (tests/events/hostile.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from kvtier.base.keys import ChunkHash
from kvtier.core.events import TierHolding
from kvtier.events.publisher import EventPublisher, PublisherConfig
from kvtier.events.subscriber import EventSubscriber
from kvtier.fleet.index import FleetIndex
from tests.events.hostile import fake_key
from tests.events.test_events import IndexSink

ROOT = Path(__file__).resolve().parents[2]
CONFIG = PublisherConfig(heartbeat_s=0.05, batch_interval_s=0.005)


def real_key(i: int) -> ChunkHash:
    return ChunkHash(hashlib.sha256(b"real-%d" % i).digest())


class Replica:
    """A publisher fed by hand, whose holdings are a fixed list of keys (and counted)."""

    def __init__(self, keys: int, config: PublisherConfig = CONFIG) -> None:
        self.keys = [real_key(i) for i in range(keys)]
        self.listed = 0
        self.publisher = EventPublisher(lambda feed: (lambda: None), self._holdings, config)

    def _holdings(self) -> list[TierHolding]:
        self.listed += 1
        return [TierHolding("memory", self.keys)]


@contextmanager
def hostile(*args: str):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "tests.events.hostile", *args], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "READY"
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)


def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def port(endpoint: str) -> int:
    return urlsplit(endpoint).port


def test_subscriptions_other_than_the_topic_are_refused_not_kept():
    """E-1: a local process opening many subscriptions makes the replica hold none of them."""
    replica = Replica(0)
    pub = replica.publisher
    try:
        with hostile("subscribe", pub.endpoint, pub.public_key.decode(), "20000"):
            until(lambda: pub.counts.get("subscription_refused", 0) == 20_000)
    finally:
        pub.close()


def test_unread_snapshot_replies_are_one_per_peer_and_encoded_once():
    """E-2: 200 snapshot requests whose replies are never read queue at most a couple of replies."""
    replica = Replica(100_000)  # a 3.4 MB snapshot
    pub = replica.publisher
    try:
        with hostile("snapshots", pub.control_endpoint, pub.public_key.decode(), "200"):
            until(lambda: pub.counts.get("snapshot_sent", 0) + pub.counts.get("snapshot_dropped", 0) == 200)
        assert pub.counts["snapshot_sent"] <= 4
        assert replica.listed == 1  # the stream did not move: one listing, one encoding, shared
    finally:
        pub.close()


def test_a_snapshot_lists_at_most_max_snapshot_keys():
    replica = Replica(1000, PublisherConfig(max_snapshot_keys=300))
    pub = replica.publisher
    index = FleetIndex()
    try:
        asyncio.run(_follow(pub, index, lambda: index.holdings("r").synced))
        assert index.chunks("r") == {"memory": 300} and pub.counts["snapshot_truncated"] == 1
    finally:
        pub.close()


async def _follow(pub: EventPublisher, index: FleetIndex, done, after=None, timeout: float = 10.0) -> dict:
    ctx = zmq.asyncio.Context()
    counts: dict[str, int] = {}
    sub = EventSubscriber(ctx, pub.endpoint, pub.control_endpoint, pub.public_key, IndexSink(index),
                          count=lambda what: counts.__setitem__(what, counts.get(what, 0) + 1))
    task = asyncio.ensure_future(sub.run())
    try:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "condition not reached"
            await asyncio.sleep(0.02)
        if after is not None:
            await after(counts)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)
    return counts


def test_an_impostor_on_a_dead_replicas_ports_feeds_nothing():
    """E-4: a process that binds a killed replica's event ports is not followed (no fake key adopted)."""
    replica = Replica(10)
    pub = replica.publisher
    index = FleetIndex()
    real = [real_key(i) for i in range(10)]
    fake = [fake_key(i) for i in range(1000)]

    async def impostor_speaks(counts: dict) -> None:
        pub.close()  # the replica dies; an impostor takes its ports at once
        with hostile("impostor", str(port(pub.endpoint)), str(port(pub.control_endpoint)), "100000"):
            await asyncio.sleep(2.0)  # the subscriber reconnects to the same ports: the handshake fails
        assert counts["snapshot"] == 1  # the real replica's only

    try:
        counts = asyncio.run(_follow(pub, index, lambda: index.cached("r", real) == {"memory": 10},
                                     impostor_speaks))
    finally:
        pub.close()
    assert index.cached("r", fake[:1]) == {} and index.chunks("r") == {"memory": 10}
    assert counts.get("new_epoch", 0) == 0 and index.dropped("r") == 0


def test_a_replica_whose_event_ports_are_taken_publishes_on_others_and_says_so(caplog):
    """E-4: with fixed event ports held by another process, the replica still starts, on free ports."""
    with _taken_ports() as (taken, taken_control):
        with caplog.at_level(logging.WARNING, logger="kvtier.events.publisher"):
            pub = EventPublisher(lambda feed: (lambda: None), lambda: [],
                                 PublisherConfig(port=taken, control_port=taken_control))
        try:
            assert port(pub.endpoint) != taken and port(pub.control_endpoint) != taken_control
            assert f"port {taken} on 127.0.0.1 is taken" in caplog.text
            assert f"port {taken_control} on 127.0.0.1 is taken" in caplog.text
        finally:
            pub.close()


@contextmanager
def _taken_ports():
    """Two ports bound by another process (a plain ZMQ PUB and ROUTER, as an old replica left them)."""
    code = ("import sys, time, zmq; c = zmq.Context(); s = [c.socket(zmq.PUB), c.socket(zmq.ROUTER)];"
            "p = [x.bind_to_random_port('tcp://127.0.0.1') for x in s]; print(*p, flush=True); time.sleep(20)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        a, b = map(int, process.stdout.readline().split())
        yield a, b
    finally:
        process.kill()
        process.wait(timeout=10)
