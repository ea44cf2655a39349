"""Publish a KVCache's events over ZMQ (PUB), and answer snapshot requests (ROUTER): one background thread.

Batches go out every ``batch_interval_s`` when there are events, and an empty one (a heartbeat) every
``heartbeat_s`` otherwise, so subscribers notice a lost batch or a restart within a heartbeat. Events wait in
a bounded queue: if a subscriber-independent backlog of ``max_queue`` events builds up (the thread starved),
the queue is dropped and the sequence skips a number, so every subscriber sees a gap and takes a snapshot
instead of trusting an incomplete stream. The sockets belong to the thread (ZMQ sockets are not
thread-safe); the cache's threads only append to the queue. See wire.py for the format.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from kvtier.errors import ConfigError
from kvtier.events.model import ChunkEvent, TierHolding
from kvtier.events.wire import SNAPSHOT_REQUEST, Batch, encode_batch, encode_snapshot, wire_event

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherConfig:
    """Where and how often. Ports 0 take free ports (the replica's ``/kvtier/info`` says which)."""

    host: str = "127.0.0.1"
    port: int = 0
    control_port: int = 0
    heartbeat_s: float = 1.0
    batch_interval_s: float = 0.02
    max_queue: int = 100_000

    def __post_init__(self) -> None:
        if not (self.heartbeat_s > 0 and self.batch_interval_s > 0 and self.max_queue > 0):
            raise ConfigError("event publisher intervals and max_queue must be positive")


class EventPublisher:
    """Publishes what ``subscribe`` feeds it; ``holdings`` gives what the cache holds now, for snapshots."""

    def __init__(self, subscribe: Callable[[Callable[[Sequence[ChunkEvent]], None]], Callable[[], None]],
                 holdings: Callable[[], list[TierHolding]], config: PublisherConfig = PublisherConfig()) -> None:
        self.config = config
        self.epoch = uuid.uuid4().hex
        self._holdings = holdings
        self._queue: deque[ChunkEvent] = deque()
        self._lock = threading.Lock()
        self._skip = 0  # sequence numbers to skip (events dropped): subscribers must see a gap
        self._seq = -1
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = _bind(self._pub, config.host, config.port)
            self._control = self._ctx.socket(zmq.ROUTER)
            self._control.setsockopt(zmq.LINGER, 0)
            self.control_endpoint = _bind(self._control, config.host, config.control_port)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ConfigError(f"cannot bind the event publisher on {config.host}: {exc}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()
        self._unsubscribe = subscribe(self._enqueue)

    def close(self) -> None:
        self._unsubscribe()
        self._running = False
        self._thread.join(timeout=10)
        self._ctx.destroy(linger=0)

    # -- producers (any thread) --------------------------------------------------------------------------------
    def _enqueue(self, events: Sequence[ChunkEvent]) -> None:
        with self._lock:
            if len(self._queue) + len(events) > self.config.max_queue:
                self._queue.clear()
                self._skip = 1
                return
            self._queue.extend(events)

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        last_sent = 0.0
        while self._running:
            if poller.poll(self.config.batch_interval_s * 1000):
                self._answer()
            now = time.monotonic()
            with self._lock:
                events, self._queue = list(self._queue), deque()
                skip, self._skip = self._skip, 0
            if events or skip or now - last_sent >= self.config.heartbeat_s:
                self._send(events, skip)
                last_sent = now

    def _send(self, events: list[ChunkEvent], skip: int) -> None:
        self._seq += 1 + skip
        payload = encode_batch(Batch(self.epoch, self._seq, time.time(), [wire_event(e) for e in events]))
        self._pub.send_multipart((b"kvtier", self._seq.to_bytes(8, "big"), payload))

    def _answer(self) -> None:
        frames = self._control.recv_multipart()
        client, request = frames[0], frames[1:]
        if request != [SNAPSHOT_REQUEST]:
            self._control.send_multipart((client, b"error", b"unknown request"))
            return
        # Queued events are not in the snapshot's seq yet but are in the listing: the subscriber applies them
        # again after it (stores and removals are idempotent), so the snapshot is never behind the stream.
        body = encode_snapshot(self.epoch, self._seq, self._holdings())
        self._control.send_multipart((client, SNAPSHOT_REQUEST, body))


def _bind(socket: zmq.Socket, host: str, port: int) -> str:
    if port:
        socket.bind(f"tcp://{host}:{port}")
        return f"tcp://{host}:{port}"
    chosen = socket.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{chosen}"
