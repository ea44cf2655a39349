"""One ``Node`` per Redis server: a bounded pool of connections and the server's circuit breaker.

A Redis tier has one node for a plain server, and one per primary for a cluster, so one dead shard costs
only the keys it owns. Connections are set up by the redis-py adapter (client.py) and then spoken to in RESP
(resp.py); a pool survives ``fork`` by forgetting the parent's sockets.
"""

from __future__ import annotations

import os
import select
import threading
from time import monotonic

from kvtier.net.breaker import CircuitBreaker
from kvtier.tiers.redis.client import Endpoint, RawConnection
from kvtier.tiers.redis.resp import RespReader, WireError, WireTimeout


class BreakerOpen(WireError):
    """The node's circuit breaker is open: it was not called."""


class PoolExhausted(WireTimeout):
    """Every connection to the node stayed busy until the deadline."""


class Conn:
    """One pooled connection: its socket, the RESP reader over it, and whether it was used before."""

    __slots__ = ("raw", "reader", "reused", "sock")

    def __init__(self, raw: RawConnection) -> None:
        self.raw = raw
        self.sock = raw.sock
        self.reader = RespReader(raw.sock)
        self.reused = False

    def idle_ok(self) -> bool:
        """An idle connection has nothing to read; readable means closed by the server (or out of step)."""
        try:
            poller = select.poll()  # not select(): descriptors past 1024 are common in servers
            poller.register(self.sock, select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self.raw.close()


class Node:
    """One server: a bounded pool of connections (``acquire`` / ``release``) and a circuit breaker."""

    def __init__(self, endpoint: Endpoint, size: int, connect_timeout: float, breaker: CircuitBreaker) -> None:
        self.name = endpoint.name
        self.endpoint = endpoint
        self.breaker = breaker
        self._size = size
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._free: list[Conn] = []
        self._slots = threading.BoundedSemaphore(size)
        self._pid = os.getpid()

    def acquire(self, deadline: float) -> Conn:
        """An idle connection that still looks alive, else a new one; PoolExhausted if none frees up in time."""
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
            return Conn(self.endpoint.connect(deadline, self._connect_timeout))
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: Conn, ok: bool) -> None:
        """Hand ``conn`` back: kept for reuse if the exchange went ``ok`` and left nothing unread, else closed."""
        if ok and conn.reader.pending == 0:
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
