"""Connections, per-node pools, Redis Cluster slot routing and the batch runner of the Redis tier.

redis-py is imported lazily here (``import kvtier`` works without it). It parses the URL and sets each
connection up (socket, TLS, AUTH/HELLO with username and password, SELECT); then ``resp`` drives it.

One ``Node`` per server (one for a plain server, one per primary for a cluster), each with its own bounded
pool and circuit breaker, so one dead shard costs only the keys it owns. ``run`` executes one pipeline per
node: it sends every node's commands first, then reads the replies, so shards work in parallel without
threads, and nothing waits past the call's deadline.
"""

from __future__ import annotations

import inspect
import logging
import os
import select
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

from kvtier.errors import ConfigError
from kvtier.net.breaker import CircuitBreaker
from kvtier.tiers.redis.resp import Into, Packer, Reader, RespError, WireClosed, WireError, WireTimeout, send_all

log = logging.getLogger(__name__)

#: Error replies meaning "this server cannot serve now": they count against its circuit breaker.
UNAVAILABLE_CODES = frozenset({"LOADING", "BUSY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"})
#: Error replies meaning "ask another node": the slot map is refreshed before the next call.
REDIRECT_CODES = frozenset({"MOVED", "ASK"})
CLUSTER_SLOTS = 16384


class BreakerOpen(WireError):
    """The node's circuit breaker is open: it was not called."""


class PoolExhausted(WireTimeout):
    """Every connection to the node stayed busy until the deadline."""


def _redis() -> Any:
    try:
        import redis
        import redis.backoff
        import redis.connection
        import redis.crc
        import redis.exceptions
        import redis.retry
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("the redis tier needs redis-py: pip install 'kvtier[redis]'") from exc
    return redis


def connection_kwargs(url: str, overrides: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The redis-py connection class and constructor arguments for ``url`` plus ``overrides``."""
    redis = _redis()
    try:
        parsed = redis.connection.parse_url(url)
    except ValueError as exc:
        raise ConfigError(f"redis url: {exc}") from None
    cls = parsed.pop("connection_class", redis.connection.Connection)
    kwargs = {**parsed, **{k: v for k, v in overrides.items() if v is not None}}
    # one attempt: the tier's deadline and circuit breaker decide what happens after a failure
    kwargs["retry"] = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    accepted = _accepted(cls)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ConfigError(f"redis url: unsupported option(s) {unknown}")
    return cls, kwargs


def _accepted(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names.update(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD)
    names.discard("self")
    return names


def key_slot(key: bytes) -> int:
    return _redis().crc.key_slot(key)


class Conn:
    """One connection: redis-py's for the set-up, our RESP reader and writer afterwards."""

    __slots__ = ("raw", "reader", "reused", "sock")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sock: Any = None
        self.reader: Reader | None = None
        self.reused = False

    def open(self, deadline: float, connect_timeout: float) -> None:
        exceptions = _redis().exceptions
        remaining = deadline - monotonic()
        if remaining <= 0:
            raise WireTimeout("deadline passed before connecting")
        self.raw.socket_connect_timeout = min(connect_timeout, remaining)
        self.raw.socket_timeout = remaining  # bounds the handshake (AUTH/HELLO, SELECT)
        try:
            self.raw.connect()
        except exceptions.TimeoutError as exc:
            raise WireTimeout(f"connect timed out: {exc}") from None
        except (exceptions.RedisError, OSError) as exc:
            raise WireClosed(f"connect failed: {exc}") from None
        sock = getattr(self.raw, "_sock", None)
        if sock is None:
            raise WireClosed("connection has no socket after connect")
        self.sock = sock
        self.reader = Reader(sock)

    def exchange(self, batch: Batch, deadline: float, rate: float) -> list[Any]:
        reader = self.reader
        assert reader is not None
        send_all(self.sock, batch.packer.pieces, deadline)
        reader.arm(deadline, rate)
        return batch.read(reader)

    def idle_ok(self) -> bool:
        """An idle connection has nothing to read; readable means closed by the server (or out of step)."""
        try:
            poller = select.poll()  # not select(): descriptors past 1024 are common in servers
            poller.register(self.sock, select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """Drop the connection; one that is already broken is dropped all the same."""
        from redis.exceptions import RedisError

        try:
            self.raw.disconnect()
        except (OSError, RedisError) as exc:
            log.debug("closing a redis connection: %s", exc)


class Node:
    """One server: a bounded pool of connections and a circuit breaker."""

    def __init__(self, name: str, make_raw: Callable[[], Any], size: int, connect_timeout: float,
                 breaker: CircuitBreaker) -> None:
        self.name = name
        self.breaker = breaker
        self._make_raw = make_raw
        self._size = size
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._free: list[Conn] = []
        self._slots = threading.BoundedSemaphore(size)
        self._pid = os.getpid()

    def acquire(self, deadline: float) -> Conn:
        if self._pid != os.getpid():
            self._after_fork()
        remaining = deadline - monotonic()
        if remaining <= 0 or not self._slots.acquire(timeout=remaining):
            raise PoolExhausted(f"no free connection to {self.name} before the deadline")
        try:
            while True:
                with self._lock:
                    conn = self._free.pop() if self._free else None
                if conn is None:
                    break
                if conn.idle_ok():
                    conn.reused = True
                    return conn
                conn.close()
            conn = Conn(self._make_raw())
            conn.open(deadline, self._connect_timeout)
            return conn
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: Conn, ok: bool) -> None:
        if ok and conn.reader is not None and conn.reader.pending == 0:
            with self._lock:
                self._free.append(conn)
        else:
            conn.close()
            if not ok:
                self.drop_idle()  # they most likely died with it (server restart, network cut)
        self._slots.release()

    def drop_idle(self) -> None:
        with self._lock:
            idle, self._free = self._free, []
        for conn in idle:
            conn.close()

    def probe(self, timeout: float) -> bool:
        """PING on a fresh connection; True when the server answered PONG."""
        deadline = monotonic() + timeout
        try:
            conn = self.acquire(deadline)
        except WireError:
            return False
        ok = False
        try:
            batch = Batch(self)
            batch.add(None, b"PING")
            batch.packer.finish()
            ok = conn.exchange(batch, deadline, 0.0) == [b"PONG"]
        except WireError:
            ok = False
        finally:
            self.release(conn, ok)
        return ok

    def _after_fork(self) -> None:
        # The parent's sockets are not ours to use or close: forget them.
        with self._lock:
            if self._pid == os.getpid():
                return
            self._free = []
            self._slots = threading.BoundedSemaphore(self._size)
            self._pid = os.getpid()

    def close(self) -> None:
        self.drop_idle()


@dataclass
class Batch:
    """One pipeline for one node; ``replies`` or ``error`` is set by ``run``."""

    node: Node
    packer: Packer = field(default_factory=Packer)
    intos: list[Into | None] = field(default_factory=list)
    tags: list[Any] = field(default_factory=list)  #: caller's bookkeeping, one per command
    replies: list[Any] | None = None
    error: WireError | None = None
    ints: bool = False  #: every reply is an integer 0/1 (EXISTS): read in bulk

    def add(self, tag: Any, *args: Any, into: Into | None = None) -> None:
        self.packer.add(*args)
        self.intos.append(into)
        self.tags.append(tag)
        self.ints = False

    def add_exists(self, tags: list[Any], keys: list[bytes]) -> None:
        """One ``EXISTS key`` per key, packed in one go."""
        self.packer.add_packed(b"".join([b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys]),
                               len(keys))
        self.ints = not self.intos or self.ints  # only EXISTS so far
        self.intos.extend([None] * len(keys))
        self.tags.extend(tags)

    def read(self, reader: Reader) -> list[Any]:
        if self.ints:
            return reader.read_ints(len(self.intos))
        return [reader.read_reply(into) for into in self.intos]


def run(batches: Sequence[Batch], deadline: float, rate: float) -> None:
    """Execute every batch (one per node): send all, then read all. Failures land in ``batch.error``.

    A pooled connection that turns out dead before the server answered (the server restarted, or dropped idle
    clients) is replaced once by a fresh one. Anything but a WireError (a bug, MemoryError) propagates after
    every connection still held is closed.
    """
    held: dict[int, tuple[Batch, Conn]] = {}
    try:
        _run(batches, deadline, rate, held)
    finally:
        for batch, conn in held.values():  # only left here when something unexpected was raised
            batch.node.release(conn, False)


def _run(batches: Sequence[Batch], deadline: float, rate: float, held: dict[int, tuple[Batch, Conn]]) -> None:
    live: list[Batch] = []
    retry: list[Batch] = []
    for batch in batches:
        if not batch.node.breaker.allow():
            batch.error = BreakerOpen(f"circuit open for {batch.node.name}")
            continue
        batch.packer.finish()
        if _send(batch, deadline, held, retry):
            live.append(batch)
    for batch in live:
        _, conn = held[id(batch)]
        reader = conn.reader
        assert reader is not None
        reader.arm(deadline, rate)
        try:
            batch.replies = batch.read(reader)
        except WireError as exc:
            del held[id(batch)]
            if conn.reused and isinstance(exc, WireClosed) and not reader.received:
                batch.node.release(conn, False)  # a stale pooled connection: the server never answered
                retry.append(batch)
            else:
                _failed(batch, conn, exc)
            continue
        del held[id(batch)]
        _finished(batch, conn)
    for batch in retry:  # once, on a fresh connection (acquire drops the stale idle ones)
        if not _send(batch, deadline, held, None):
            continue
        _, conn = held[id(batch)]
        assert conn.reader is not None
        conn.reader.arm(deadline, rate)
        try:
            batch.replies = batch.read(conn.reader)
        except WireError as exc:
            del held[id(batch)]
            _failed(batch, conn, exc)
            continue
        del held[id(batch)]
        _finished(batch, conn)


def _send(batch: Batch, deadline: float, held: dict[int, tuple[Batch, Conn]], retry: list[Batch] | None) -> bool:
    try:
        conn = batch.node.acquire(deadline)
    except WireError as exc:
        _failed(batch, None, exc)
        return False
    held[id(batch)] = (batch, conn)
    try:
        send_all(conn.sock, batch.packer.pieces, deadline)
    except WireError as exc:
        del held[id(batch)]
        if retry is not None and conn.reused and isinstance(exc, WireClosed):
            batch.node.release(conn, False)
            retry.append(batch)
        else:
            _failed(batch, conn, exc)
        return False
    return True


def _finished(batch: Batch, conn: Conn) -> None:
    batch.node.release(conn, True)
    assert batch.replies is not None
    if any(isinstance(r, RespError) and r.code in UNAVAILABLE_CODES for r in batch.replies):
        batch.node.breaker.failure()
    else:
        batch.node.breaker.success()


def _failed(batch: Batch, conn: Conn | None, exc: WireError) -> None:
    batch.error = exc
    batch.replies = None
    if conn is not None:
        batch.node.release(conn, False)
    if not isinstance(exc, PoolExhausted):  # local contention says nothing about the server
        batch.node.breaker.failure()


def parse_cluster_slots(reply: Any, seed_host: str) -> list[tuple[int, int, str, int]]:
    """``CLUSTER SLOTS`` -> [(first_slot, last_slot, primary_host, primary_port)]."""
    if not isinstance(reply, list):
        raise WireClosed(f"unexpected CLUSTER SLOTS reply: {reply!r}"[:200])
    ranges = []
    for entry in reply:
        try:
            first, last, primary = int(entry[0]), int(entry[1]), entry[2]
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            port = int(primary[1])
        except (IndexError, TypeError, ValueError, AttributeError):
            raise WireClosed("malformed CLUSTER SLOTS reply") from None
        if host in ("", "?"):
            host = seed_host
        ranges.append((first, last, host, port))
    return ranges


def is_redirect(reply: Any) -> bool:
    return isinstance(reply, RespError) and reply.code in REDIRECT_CODES
