"""The pipeline runner of the Redis tier: one pipeline (``Batch``) per server, sent and read in one go.

``run_batches`` sends every node's commands first, then reads the replies, so shards work in parallel without
threads, and nothing waits past the call's deadline. Failures land in each batch (``error``), never raise:
the tier turns them into misses and skipped stores. Each exchange reports to the node's circuit breaker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

from kvtier.tiers.redis.pool import BreakerOpen, Conn, Node, PoolExhausted
from kvtier.tiers.redis.resp import Into, Packer, RespError, RespReader, WireClosed, WireError, send_all

#: Error replies meaning "this server cannot serve now": they count against its circuit breaker.
UNAVAILABLE_CODES = frozenset({"LOADING", "BUSY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"})
#: Error replies meaning "ask another node": the slot map is refreshed before the next call.
REDIRECT_CODES = frozenset({"MOVED", "ASK"})


def is_redirect(reply: Any) -> bool:
    return isinstance(reply, RespError) and reply.code in REDIRECT_CODES


@dataclass
class Batch:
    """One pipeline for one node; ``replies`` or ``error`` is set by ``run_batches``."""

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

    def read(self, reader: RespReader) -> list[Any]:
        if self.ints:
            return reader.read_ints(len(self.intos))
        return [reader.read_reply(into) for into in self.intos]


def run_batches(batches: Sequence[Batch], deadline: float, rate: float) -> None:
    """Execute every batch (one per node) whose node's breaker allows it: send all, then read all.

    A pooled connection that turns out dead before the server answered (the server restarted, or dropped idle
    clients) is replaced once by a fresh one. Anything but a WireError (a bug, MemoryError) propagates after
    every connection still held is closed.
    """
    admitted = []
    for batch in batches:
        if batch.node.breaker.allow():
            batch.packer.finish()
            admitted.append(batch)
        else:
            batch.error = BreakerOpen(f"circuit open for {batch.node.name}")
    held: dict[int, tuple[Batch, Conn]] = {}
    try:
        # at most two rounds: the second resends, on fresh connections, what met a stale pooled one
        stale = _round(admitted, deadline, rate, held, retry_stale=True)
        _round(stale, deadline, rate, held, retry_stale=False)
    finally:
        for batch, conn in held.values():  # only left here when something unexpected was raised
            batch.node.release(conn, False)


def probe(node: Node, timeout: float) -> bool:
    """PING ``node`` whatever its breaker says; True when it answered PONG. The breaker is the caller's to
    close: only a PONG shows the server serves again (an error reply, say NOAUTH, does not)."""
    deadline = monotonic() + timeout
    try:
        conn = node.acquire(deadline)
    except WireError:
        return False
    ok = False
    try:
        batch = Batch(node)
        batch.add(None, b"PING")
        conn.reader.arm(deadline, 0.0)
        send_all(conn.sock, batch.packer.finish(), deadline)
        ok = batch.read(conn.reader) == [b"PONG"]
    except WireError:
        ok = False
    finally:
        node.release(conn, ok)
    return ok


def _round(batches: list[Batch], deadline: float, rate: float, held: dict[int, tuple[Batch, Conn]],
           retry_stale: bool) -> list[Batch]:
    """Send every batch, then read every reply; return the batches whose reused connection was found dead
    before the server answered (when ``retry_stale``), to be sent again."""
    stale: list[Batch] = []
    sent: list[Batch] = []
    for batch in batches:
        try:
            conn = batch.node.acquire(deadline)
        except WireError as exc:
            _failed(batch, None, exc)
            continue
        held[id(batch)] = (batch, conn)
        conn.reader.arm(deadline, rate)
        try:
            send_all(conn.sock, batch.packer.pieces, deadline)
        except WireError as exc:
            _settle(batch, held, exc, stale if retry_stale else None)
            continue
        sent.append(batch)
    for batch in sent:
        try:
            batch.replies = batch.read(held[id(batch)][1].reader)
        except WireError as exc:
            _settle(batch, held, exc, stale if retry_stale else None)
            continue
        _settle(batch, held, None, None)
    return stale


def _settle(batch: Batch, held: dict[int, tuple[Batch, Conn]], exc: WireError | None,
          stale: list[Batch] | None) -> None:
    """Release the batch's connection and settle its outcome: replies, a failure, or a retry (into ``stale``)."""
    _, conn = held.pop(id(batch))
    if exc is None:
        batch.node.release(conn, True)
        assert batch.replies is not None
        if any(isinstance(r, RespError) and r.code in UNAVAILABLE_CODES for r in batch.replies):
            batch.node.breaker.failure()
        else:
            batch.node.breaker.success()
    elif stale is not None and conn.reused and isinstance(exc, WireClosed) and not conn.reader.received:
        batch.node.release(conn, False)  # a stale pooled connection: the server never answered
        stale.append(batch)
    else:
        _failed(batch, conn, exc)


def _failed(batch: Batch, conn: Conn | None, exc: WireError) -> None:
    batch.error = exc
    batch.replies = None
    if conn is not None:
        batch.node.release(conn, False)
    if not isinstance(exc, PoolExhausted):  # local contention says nothing about the server
        batch.node.breaker.failure()
