"""Publish a KVCache's events over ZMQ (XPUB), and answer snapshot requests (ROUTER): one background thread.

Batches go out every ``batch_interval_s`` when there are events, and an empty one (a heartbeat) every
``heartbeat_s`` otherwise, so subscribers notice a lost batch or a restart within a heartbeat. Events wait in
a bounded queue: if a subscriber-independent backlog of ``max_queue`` events builds up (the thread starved),
the queue is dropped and the sequence skips a number, so every subscriber sees a gap and takes a snapshot
instead of trusting an incomplete stream. The sockets belong to the thread (ZMQ sockets are not
thread-safe); the cache's threads only append to the queue. See wire.py for the format.

Both sockets are CURVE servers with a key pair drawn at start: the public key is in ``/kvtier/info``, so a
router that read it from the replica it was configured with talks only to this process (a process that takes
the ports after this one died cannot complete the handshake). Clients are authenticated too: the thread
answers ZAP for this publisher's sockets and lets only the keys ``PublisherConfig.allow`` names complete the
handshake (kvtier.events.keys); a refused client sends nothing, and its key is logged once (what to add to
``--events-allow``). What an allowed peer can make this process hold is bounded by ZMQ's own limits:

* subscriptions: the PUB side is an XPUB in manual mode; only prefixes of the one topic (``b"kvtier"``) are
  subscribed, anything else is dropped and counted. libzmq still records every subscription a peer sends
  (to unsubscribe it when the peer leaves), which only the allow-list bounds. Inbound messages are capped at
  ``MAX_INBOUND_BYTES``;
* send buffers: at most ``send_hwm`` batches wait per subscriber (then ZMQ drops for that subscriber only, which
  it sees as a gap); batches are shared between subscribers, not copied;
* snapshots: a peer has at most one reply queued (HWM 1 and ROUTER_MANDATORY: another request meanwhile is
  dropped and counted); a reply lists at most ``max_snapshot_keys`` keys (fastest tiers first) and is encoded
  once per stream position, the same bytes shared by every peer that asks.

A fixed port that is taken (another process bound it) is replaced by a free one, with a warning: the replica
still starts and ``/kvtier/info`` names where it publishes.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from kvtier.base.errors import ConfigError
from kvtier.base.threads import WATCHED
from kvtier.core.events import ChunkEvent, TierHolding
from kvtier.events.keys import Allow, Allowed
from kvtier.events.wire import SNAPSHOT_REQUEST, TOPIC, Batch, encode_batch, encode_snapshot, wire_event

log = logging.getLogger(__name__)

#: Peers send subscriptions (7 bytes at most), snapshot requests (8) and CURVE handshake commands (HELLO: 200,
#: INITIATE: ~300 with metadata): anything longer disconnects them.
MAX_INBOUND_BYTES = 1024
#: Subscriptions, and snapshot requests, handled per loop turn each (a flood must not hold back the batches).
MAX_MESSAGES_PER_TURN = 10_000
#: Where libzmq asks a context's ZAP handler (RFC 27) about each handshake.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: Refused client keys logged (once each); beyond, refusals are only counted.
MAX_LOGGED_REFUSALS = 64


@dataclass(frozen=True)
class PublisherConfig:
    """Where and how often. Ports 0 take free ports (the replica's ``/kvtier/info`` says which).

    ``send_hwm``: batches queued per subscriber; ``max_snapshot_keys``: keys in one snapshot reply;
    ``allow``: the client keys that may subscribe or ask for snapshots (by default only this user's local
    ``kvtier route``).
    """

    host: str = "127.0.0.1"
    port: int = 0
    control_port: int = 0
    heartbeat_s: float = 1.0
    batch_interval_s: float = 0.02
    max_queue: int = 100_000
    send_hwm: int = 100
    max_snapshot_keys: int = 2_000_000
    allow: Allow = Allow()

    def __post_init__(self) -> None:
        if not (self.heartbeat_s > 0 and self.batch_interval_s > 0 and self.max_queue > 0):
            raise ConfigError("event publisher intervals and max_queue must be positive")
        if self.send_hwm < 1 or self.max_snapshot_keys < 0:
            raise ConfigError("event publisher send_hwm must be >= 1 and max_snapshot_keys >= 0")


class EventPublisher:
    """Publishes what ``subscribe`` feeds it; ``holdings`` gives what the cache holds now, for snapshots.

    ``public_key`` (Z85) is what subscribers must expect; ``counts`` counts snapshots sent, replies dropped
    (``snapshot_dropped``), truncated snapshots, refused subscriptions and refused clients (``client_refused``).
    """

    def __init__(self, subscribe: Callable[[Callable[[Sequence[ChunkEvent]], None]], Callable[[], None]],
                 holdings: Callable[[], list[TierHolding]], config: PublisherConfig = PublisherConfig()) -> None:
        self.config = config
        self.epoch = uuid.uuid4().hex
        self.public_key, secret_key = zmq.curve_keypair()
        self.counts: dict[str, int] = {}
        self._holdings = holdings
        self._queue: deque[ChunkEvent] = deque()
        self._lock = threading.Lock()
        self._skip = 0  # sequence numbers to skip (events dropped): subscribers must see a gap
        self._seq = -1
        self._snapshot: tuple[int, bytes] | None = None  # (seq, encoded): shared by every reply at that seq
        self._ctx = zmq.Context()
        self._allowed = Allowed(config.allow)
        self._refused_keys: set[bytes] = set()
        try:
            self._zap = self._ctx.socket(zmq.REP)  # bound first: every handshake of the sockets below asks it
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(ZAP_ENDPOINT)
            self._pub = self._socket(zmq.XPUB, secret_key)
            self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
            self._pub.setsockopt(zmq.SNDHWM, config.send_hwm)
            self.endpoint = _bind(self._pub, config.host, config.port, "event")
            self._control = self._socket(zmq.ROUTER, secret_key)
            self._control.setsockopt(zmq.SNDHWM, 1)
            self._control.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.control_endpoint = _bind(self._control, config.host, config.control_port, "event control")
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ConfigError(f"cannot bind the event publisher on {config.host}: {exc}") from None
        self._running = True
        self._last_sent = 0.0
        self._thread = WATCHED.watch(threading.Thread(target=self._run, name="kvtier-events", daemon=True))
        self._thread.start()
        self._unsubscribe = subscribe(self._enqueue)

    def _socket(self, kind: int, secret_key: bytes) -> zmq.Socket:
        socket = self._ctx.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        socket.curve_secretkey = secret_key
        socket.curve_server = True
        return socket

    def close(self) -> None:
        self._unsubscribe()
        WATCHED.unwatch(self._thread)
        self._running = False
        self._thread.join(timeout=10)
        self._ctx.destroy(linger=0)

    def _counted(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

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
        """The thread: one turn per poll. What one turn raises (a peer's message it chokes on, a bug) is logged
        and counted (``counts["errors"]``), its batch becomes a gap subscribers see, and the next turn runs."""
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        self._last_sent = 0.0
        while self._running:
            try:
                self._turn(poller)
            except Exception:
                log.exception("event publisher: a turn failed; its events are a gap, the next turn goes on")
                self._counted("errors")
                with self._lock:
                    self._skip = max(self._skip, 1)
                time.sleep(self.config.batch_interval_s)  # a failure that repeats does not spin

    def _turn(self, poller: zmq.Poller) -> None:
        ready = dict(poller.poll(self.config.batch_interval_s * 1000))
        if self._zap in ready:
            self._authenticate()
        if self._pub in ready:
            self._subscriptions()
        if self._control in ready:
            self._answer()
        now = time.monotonic()
        with self._lock:
            events, self._queue = list(self._queue), deque()
            skip, self._skip = self._skip, 0
        if events or skip or now - self._last_sent >= self.config.heartbeat_s:
            try:
                self._send(events, skip)
            except Exception:
                with self._lock:  # these events are lost: the next batch skips a number for them
                    self._skip += 1
                raise
            self._last_sent = now

    def _send(self, events: list[ChunkEvent], skip: int) -> None:
        self._seq += 1 + skip
        payload = encode_batch(Batch(self.epoch, self._seq, time.time(), [wire_event(e) for e in events]))
        self._pub.send_multipart((TOPIC, self._seq.to_bytes(8, "big"), payload), copy=False)

    def _authenticate(self) -> None:
        """Answer the ZAP requests waiting (RFC 27): 200 for an allowed CURVE client key, 400 otherwise."""
        for _ in range(MAX_MESSAGES_PER_TURN):
            try:
                request = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            version, request_id = (request + [b"", b""])[:2]
            key = request[6] if len(request) >= 7 and request[5] == b"CURVE" else b""
            ok = version == b"1.0" and self._allowed.allows(key)
            if not ok:
                self._refused(key, request[3] if len(request) > 3 else b"?")
            self._zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400", b"OK" if ok else b"not allowed",
                                      b"router" if ok else b"", b""])

    def _refused(self, key: bytes, address: bytes) -> None:
        self._counted("client_refused")
        if len(self._refused_keys) < MAX_LOGGED_REFUSALS and key not in self._refused_keys:
            self._refused_keys.add(key)
            shown = z85.encode(key).decode() if len(key) == 32 else "none"
            log.warning("event sockets: refused a client from %s with key %s (kvtier serve --events-allow KEY "
                        "lets a router in)", address.decode(errors="replace"), shown)

    def _subscriptions(self) -> None:
        """Subscribe each peer to what it asked for if that is a prefix of the topic; refuse anything else."""
        for _ in range(MAX_MESSAGES_PER_TURN):
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            topic = message[1:]
            if message[:1] in (b"\x00", b"\x01") and TOPIC.startswith(topic):
                option = zmq.SUBSCRIBE if message[:1] == b"\x01" else zmq.UNSUBSCRIBE
                self._pub.setsockopt(option, topic)  # manual mode: applies to the peer that sent ``message``
            else:
                self._counted("subscription_refused")

    def _answer(self) -> None:
        for _ in range(MAX_MESSAGES_PER_TURN):
            try:
                frames = self._control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            client, request = frames[0], frames[1:]
            if request != [SNAPSHOT_REQUEST]:
                self._reply(client, b"error", b"unknown request")
                continue
            if self._reply(client, SNAPSHOT_REQUEST, self._snapshot_body()):
                self._counted("snapshot_sent")
            else:
                self._counted("snapshot_dropped")

    def _reply(self, client: bytes, kind: bytes, body: bytes) -> bool:
        """Queue a reply unless the peer still has one unread (or left): False then, and nothing is queued."""
        try:
            self._control.send_multipart((client, kind, body), zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return False
            raise

    def _snapshot_body(self) -> bytes:
        """The snapshot at the current seq, encoded once. Queued events are not in its seq yet but are in the
        listing: the subscriber applies them again after it (stores and removals are idempotent), so the
        snapshot is never behind the stream; nor is one taken earlier at the same seq."""
        if self._snapshot is not None and self._snapshot[0] == self._seq:
            return self._snapshot[1]
        held, room = [], self.config.max_snapshot_keys
        for holding in self._holdings():
            if holding.keys is not None and len(holding.keys) > room:
                self._counted("snapshot_truncated")
                log.warning("event snapshot: tier %s lists %d keys, %d sent (max_snapshot_keys)", holding.name,
                            len(holding.keys), room)
                holding = TierHolding(holding.name, holding.keys[:room], holding.store_id)
            room -= len(holding.keys or ())
            held.append(holding)
        self._snapshot = (self._seq, encode_snapshot(self.epoch, self._seq, held))
        return self._snapshot[1]


def _bind(socket: zmq.Socket, host: str, port: int, what: str) -> str:
    if port:
        try:
            socket.bind(f"tcp://{host}:{port}")
            return f"tcp://{host}:{port}"
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
        chosen = socket.bind_to_random_port(f"tcp://{host}")
        log.warning("%s port %d on %s is taken by another process: publishing on port %d instead", what, port,
                    host, chosen)
        return f"tcp://{host}:{chosen}"
    chosen = socket.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{chosen}"
