"""Issue 29, E-1/E-2/E-4: hostile processes against a replica's event sockets and a router's subscriber.

The replicas here allow the default router key of this user (kvtier.events.keys), which the subscribers use;
the hostile peers bring keys of their own.

Each hostile peer is a process of its own speaking the real wire format (harness/hostile_events.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import zmq
import zmq.asyncio

from kvtier.base.errors import ConfigError
from kvtier.base.keys import ChunkHash
from kvtier.core.events import TierHolding
from kvtier.events.keys import Allow, default_key_file, load_or_create
from kvtier.events.publisher import EventPublisher, PublisherConfig
from kvtier.events.subscriber import EventSubscriber, SubscriberConfig
from kvtier.events.wire import SNAPSHOT_REQUEST
from kvtier.fleet.index import FleetIndex
from harness.hostile_events import fake_key
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
    process = subprocess.Popen([sys.executable, "-m", "harness.hostile_events", *args], cwd=ROOT, env=env,
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


def test_a_client_whose_key_is_not_allowed_never_subscribes():
    """E-1: a local process with a key of its own cannot complete the handshake, so none of its 20,000
    subscriptions reaches the replica (libzmq would record each one while it stays connected)."""
    replica = Replica(0)
    pub = replica.publisher
    try:
        with hostile("subscribe", pub.endpoint, pub.public_key.decode(), "20000"):
            until(lambda: pub.counts.get("client_refused", 0) >= 1)
            time.sleep(0.5)  # room for subscriptions to arrive, were the peer let in
        assert pub.counts.get("subscription_refused", 0) == 0
    finally:
        pub.close()


def test_subscriptions_of_an_allowed_client_other_than_the_topic_are_refused_not_kept():
    """E-1 with ``allow.any`` (the old behaviour) or the peer's key allowed: only the topic is subscribed."""
    replica = Replica(0, dataclasses.replace(CONFIG, allow=Allow(any=True)))
    pub = replica.publisher
    try:
        with hostile("subscribe", pub.endpoint, pub.public_key.decode(), "20000"):
            until(lambda: pub.counts.get("subscription_refused", 0) == 20_000)
        assert pub.counts.get("client_refused", 0) == 0
    finally:
        pub.close()


def test_only_allowed_keys_get_snapshots_and_the_router_key_file_is_allowed(tmp_path):
    """E-1: a key named in ``allow.keys`` and the key in ``allow.local_key_file`` are served; another is not."""
    named_public, named_secret = zmq.curve_keypair()
    local = load_or_create(tmp_path / "route.key")
    assert load_or_create(tmp_path / "route.key") == local  # created once, then read
    replica = Replica(3, dataclasses.replace(CONFIG, allow=Allow(keys=(named_public.decode(),),
                                                                 local_key_file=str(tmp_path / "route.key"))))
    pub = replica.publisher
    try:
        got = {who: _snapshot_with(pub, key) for who, key in
               (("named", (named_public, named_secret)), ("local", local), ("other", zmq.curve_keypair()))}
    finally:
        pub.close()
    assert got == {"named": True, "local": True, "other": False}
    assert pub.counts["client_refused"] >= 1


def test_a_router_whose_key_the_replica_does_not_allow_learns_nothing_and_one_it_allows_follows():
    """E-1 from the router's side: the subscriber's key is the router's; a replica allowing another key gives it
    no snapshot (it keeps asking), and the replica's allowed router is followed."""
    router_key = zmq.curve_keypair()
    replica = Replica(5, dataclasses.replace(CONFIG, allow=Allow(keys=(router_key[0].decode(),), local_key_file=None)))
    pub = replica.publisher
    quick = SubscriberConfig(snapshot_timeout_s=0.3, retry_s=0.05)
    try:
        stranger, allowed = FleetIndex(), FleetIndex()
        async def has_failed(counts: dict) -> None:
            for _ in range(200):
                if counts.get("snapshot_failed"):
                    return
                await asyncio.sleep(0.05)

        counts = asyncio.run(_follow(pub, stranger, lambda: pub.counts.get("client_refused", 0) >= 2, has_failed,
                                     client_key=zmq.curve_keypair(), config=quick))
        assert counts.get("snapshot", 0) == 0 and counts["snapshot_failed"] >= 1 and stranger.chunks("r") == {}
        asyncio.run(_follow(pub, allowed, lambda: allowed.holdings("r").synced, client_key=router_key, config=quick))
        assert allowed.chunks("r") == {"memory": 5}
    finally:
        pub.close()


def test_kvtier_serve_reads_its_allow_list_from_flags_or_the_environment(monkeypatch):
    from argparse import Namespace

    from kvtier.apps.serve.cli import events_allow

    key = zmq.curve_keypair()[0].decode()
    assert events_allow(Namespace(events_allow=[key])) == Allow(keys=(key,))
    assert events_allow(Namespace(events_allow=["any"])).any
    monkeypatch.setenv("KVTIER_EVENTS_ALLOW", f"{key}, ")
    assert events_allow(Namespace(events_allow=None)) == Allow(keys=(key,))
    monkeypatch.setenv("KVTIER_EVENTS_ALLOW", "not-a-key")
    with pytest.raises(ConfigError):
        events_allow(Namespace(events_allow=None))


def _snapshot_with(pub: EventPublisher, key: tuple[bytes, bytes]) -> bool:
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.curve_publickey, dealer.curve_secretkey = key
        dealer.curve_serverkey = pub.public_key
        dealer.connect(pub.control_endpoint)
        dealer.send(SNAPSHOT_REQUEST)
        return bool(dealer.poll(3000))
    finally:
        ctx.destroy(linger=0)


def test_unread_snapshot_replies_are_one_per_peer_and_encoded_once():
    """E-2: 200 snapshot requests whose replies are never read queue at most a couple of replies (a peer that
    is let in: it has the router's key)."""
    replica = Replica(100_000)  # a 3.4 MB snapshot
    pub = replica.publisher
    try:
        with hostile("snapshots", pub.control_endpoint, pub.public_key.decode(), "200", str(default_key_file())):
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


async def _follow(pub: EventPublisher, index: FleetIndex, done, after=None, timeout: float = 10.0,
                  client_key: tuple[bytes, bytes] | None = None,
                  config: SubscriberConfig = SubscriberConfig()) -> dict:
    ctx = zmq.asyncio.Context()
    counts: dict[str, int] = {}
    sub = EventSubscriber(ctx, pub.endpoint, pub.control_endpoint, pub.public_key, IndexSink(index), config,
                          count=lambda what: counts.__setitem__(what, counts.get(what, 0) + 1), client_key=client_key)
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
