"""The per-rank server's HTTP loop: the standard library's request handlers, with every connection bounded.

vLLM's worker process has no event loop to serve from, and a thread per connection (``ThreadingHTTPServer``)
lets idle connections hold a thread and a descriptor each for ever (1,500 of them: 1,504 threads). So
``RankHTTPServer`` waits for connections' first bytes on one thread (a selector), and only a connection with a
request arriving gets a worker thread, for that one request:

* an accepted connection that sends nothing for ``IDLE_TIMEOUT_S`` is closed; at ``MAX_CONNECTIONS`` open ones,
  a new connection closes the one that has waited longest without sending a byte (it has no request to lose), so
  a flood of idle connections cannot lock out a scrape or an admin call; only when every open connection is
  being answered is a new one answered 503 (``Retry-After: 1``) and closed at once;
* at most ``MAX_WORKERS`` requests are read and answered at once (more: 503); a request must arrive whole
  within ``REQUEST_TIMEOUT_S`` of its first byte (else the connection is closed), and each wait for bytes, in
  either direction, is at most ``IDLE_TIMEOUT_S``;
* each answer closes its connection (``Connection: close``): a client's next request, a Prometheus scrape's
  included, opens a new one, so no idle connection ever holds a worker.

So the threads are at most ``MAX_WORKERS`` + 1 and the descriptors ``MAX_CONNECTIONS`` + 1, whatever clients do.
"""

from __future__ import annotations

import io
import json
import logging
import selectors
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

from kvtier.api.errors import error_body

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  #: connections open at once (waiting for a request, or being answered)
MAX_WORKERS = 32  #: requests read and answered at once, one thread each
IDLE_TIMEOUT_S = 5.0  #: the longest wait for a connection's next bytes (or for the client to take ours)
REQUEST_TIMEOUT_S = 15.0  #: a request's head and body arrive whole within this of its first byte
_ACCEPTS_PER_TURN = 64


def _busy_answer() -> bytes:
    body = json.dumps(error_body("this server is busy; retry later", 503)).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\nretry-after: 1\r\n\r\n" % len(body)) + body


_BUSY = _busy_answer()


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, each wait at most ``IDLE_TIMEOUT_S`` and none past ``deadline`` (TimeoutError then,
    which http.server answers by closing the connection)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(min(IDLE_TIMEOUT_S, left))
        return self._sock.recv_into(buffer)


class BoundedHandler(BaseHTTPRequestHandler):
    """A handler for ``RankHTTPServer``: one request per connection, read against its deadline. Subclasses
    answer with ``reply``."""

    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own file object: replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + REQUEST_TIMEOUT_S))

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()

    def reply(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


class RankHTTPServer:
    """Serves ``handler`` on ``(host, port)`` (port 0: any free one; ``port`` says which) from ``serve_forever``
    until ``shutdown``; see the module docstring for the bounds."""

    def __init__(self, address: tuple[str, int], handler: type[BoundedHandler], *,
                 max_connections: int = MAX_CONNECTIONS, max_workers: int = MAX_WORKERS) -> None:
        # a deep accept queue: with 128, a flood of connections overflowed it and a scrape's SYN was dropped and
        # resent a second later (a 1 s /metrics probe in the hostile run); the kernel caps it at somaxconn
        self.socket = socket.create_server(address, backlog=MAX_CONNECTIONS)
        self.socket.setblocking(False)
        self.port = self.socket.getsockname()[1]
        self._handler, self._max_connections = handler, max_connections
        self._workers = threading.BoundedSemaphore(max_workers)
        self._busy = 0  # connections handed to a worker and not yet closed
        self._busy_lock = threading.Lock()
        self._waiting: dict[socket.socket, tuple[object, float]] = {}  # connection -> (address, deadline)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._stop = threading.Event()
        self.refused = 0  #: connections answered 503
        self.evicted = 0  #: idle connections closed to make room for a new one

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=0.25):
                    if key.fileobj is self.socket:
                        self._accept()
                    else:
                        self._dispatch(key.fileobj)  # type: ignore[arg-type]
                self._expire()
        finally:
            for conn in list(self._waiting):
                self._drop(conn)
            self._selector.close()
            self.socket.close()

    def shutdown(self) -> None:
        self._stop.set()

    @property
    def connections(self) -> tuple[int, int]:
        """(waiting for a request, being answered) connections now."""
        return len(self._waiting), self._busy

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                conn, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the waiting connections time out and free some
                log.warning("kvtier admin server: accept failed: %s", exc)
                return
            if len(self._waiting) + self._busy >= self._max_connections:
                if not self._waiting:
                    self._refuse(conn)
                    continue
                self._drop(next(iter(self._waiting)))  # the oldest: dicts keep insertion order
                self.evicted += 1
            conn.setblocking(False)
            self._waiting[conn] = (address, time.monotonic() + IDLE_TIMEOUT_S)
            self._selector.register(conn, selectors.EVENT_READ)

    def _dispatch(self, conn: socket.socket) -> None:
        address, _ = self._drop(conn, close=False)
        if not self._workers.acquire(blocking=False):
            self._refuse(conn)
            return
        with self._busy_lock:
            self._busy += 1
        threading.Thread(target=self._work, args=(conn, address), name="kvtier-admin-request", daemon=True).start()

    def _work(self, conn: socket.socket, address: object) -> None:
        try:
            conn.setblocking(True)
            self._handler(conn, address, self)
        except Exception as exc:  # noqa: BLE001 - a client's broken connection ends its request only
            log.debug("kvtier admin server: a connection failed: %r", exc)
        finally:
            _close(conn)
            with self._busy_lock:
                self._busy -= 1
            self._workers.release()

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c, (_, deadline) in self._waiting.items() if deadline <= now]:
            self._drop(conn)

    def _drop(self, conn: socket.socket, close: bool = True) -> tuple[object, float]:
        self._selector.unregister(conn)
        entry = self._waiting.pop(conn)
        if close:
            _close(conn)
        return entry

    def _refuse(self, conn: socket.socket) -> None:
        self.refused += 1
        try:
            conn.setblocking(False)
            conn.send(_BUSY)  # a few hundred bytes: the send buffer takes them at once, or the client gets none
        except OSError:
            pass
        _close(conn)


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


