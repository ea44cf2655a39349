"""HTTP/1.1 limits uvicorn does not enforce, for any kvtier server that faces untrusted clients.

uvicorn's httptools protocol (the one ``http="auto"`` picks) reads a request head of any size into memory,
waits forever for a head or a body that never ends (``timeout_keep_alive`` covers only the idle time between
requests), and accepts connections until the process runs out of file descriptors (``limit_concurrency``
answers 503 only once a head is complete, so half-sent heads still hold theirs). ``h11_max_incomplete_event_size``
caps heads for the h11 protocol only, with a 400. So ``guarded_protocol`` subclasses the httptools protocol:

* a head larger than ``max_head_bytes`` is a 431 as soon as that many bytes arrived without its end, one with
  more than ``max_headers`` header lines a 431;
* a head not complete ``head_timeout_s`` after the connection opened (or after its first byte, on a
  kept-alive connection) is a 408; so is a body that sends nothing for ``body_timeout_s``;
* a connection beyond ``max_connections`` open ones is answered 503 (``Retry-After: 1``) and closed at once,
  with bytes made once and before uvicorn sets the connection up: a flood of connections costs the server
  little next to what opening them costs the flooder (measured: 70-75 us each against ~950 us).

Each answer carries ``Connection: close`` and OpenAI's error envelope, closes the connection, and is reported
to ``on_refused(status, reason)`` (for metrics). Responses the app already started are never written over.

``kvtier serve`` and ``kvtier route`` both enforce them, set by the same flags (``add_http_limit_flags``,
``http_limits``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.api.errors import error_body
from kvtier.base.errors import ConfigError
from kvtier.base.sizes import parse_size

FD_RESERVE = 256  #: descriptors kept for what the process opens itself (replica pools, ZMQ, files)
REFUSALS_PER_TURN = 32  #: timed-out connections answered per event-loop turn (~3 ms of work)


#: how long kvtier's HTTP clients (kvtier bench, kvtier route's to its replicas) keep an idle connection for
#: reuse: below the 5 s that uvicorn's servers (kvtier route, kvtier serve, vLLM's) keep one open, so that a
#: client never sends on a connection the server is closing at that moment, which fails with no response at all
#: (httpx's own default is 5 s too)
CLIENT_KEEPALIVE_S = 2.0


@dataclass(frozen=True)
class HttpLimits:
    """Limits per connection and per server; see the module docstring."""

    max_head_bytes: int = 64 << 10
    max_headers: int = 100
    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5
    max_connections: int = 2048

    def __post_init__(self) -> None:
        if min(self.max_head_bytes, self.max_headers, self.max_connections, self.keep_alive_s) < 1 or min(
                self.head_timeout_s, self.body_timeout_s) <= 0:
            raise ConfigError("HTTP limits must be positive")

    def connection_cap(self) -> int:
        """``max_connections``, lowered to leave ``FD_RESERVE`` of the process's descriptor limit free."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - FD_RESERVE))


def add_http_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``HttpLimits``, in a group of their own, defaulting to its defaults."""
    d = HttpLimits()
    g = parser.add_argument_group("HTTP limits (per client connection)")
    g.add_argument("--max-head-bytes", default=f"{d.max_head_bytes >> 10}KiB",
                   help="largest request head (request line and headers); larger get 431 (default %(default)s)")
    g.add_argument("--max-headers", type=int, default=d.max_headers,
                   help="most header lines in a request; more get 431 (default %(default)s)")
    g.add_argument("--head-timeout", type=float, default=d.head_timeout_s,
                   help="seconds for a request head to arrive whole; then 408 (default %(default)s)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds a request body may send nothing; then 408 (default %(default)s)")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="client connections open at once; more get 503 (default %(default)s, lowered to leave "
                        f"{FD_RESERVE} file descriptors free)")


def http_limits(args: argparse.Namespace) -> HttpLimits:
    """The HttpLimits that ``add_http_limit_flags``' flags describe (ConfigError if one is not positive)."""
    return HttpLimits(max_head_bytes=parse_size(args.max_head_bytes), max_headers=args.max_headers,
                      head_timeout_s=args.head_timeout, body_timeout_s=args.body_timeout,
                      max_connections=args.max_connections)


def guarded_protocol(limits: HttpLimits, on_refused: Callable[[int, str], None] = lambda status, reason: None):
    """An httptools protocol class for ``uvicorn.Config(http=...)`` that enforces ``limits``."""
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol  # (CLIs parse without it)

    cap = limits.connection_cap()
    busy = _answer(STATUS_LINE[503], f"this server has {cap} connections open; retry later", 503)
    expired: deque = deque()  # (protocol, token): connections whose deadline passed, refused a few per loop turn

    def refuse_expired(loop: asyncio.AbstractEventLoop) -> None:
        for _ in range(REFUSALS_PER_TURN):
            if not expired:
                return
            protocol, token = expired.popleft()
            protocol._expired(token)
        loop.call_soon(refuse_expired, loop)  # the rest after the loop has seen to everything else once

    class GuardedHttpProtocol(HttpToolsProtocol):
        #: for a server that accepts connections itself (kvtier.web.accept): refuse them at the cap before any
        #: transport or protocol is made, with these bytes, counting each with ``count_refusal``
        connection_cap, busy_answer, count_refusal = cap, busy, staticmethod(on_refused)

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None
            self._deadline: tuple[int, str] | None = None  # (status, reason) of the armed deadline
            self._token = 0  # which arming of the deadline an expiry belongs to
            self._in_head = True
            self._head_bytes = self._header_count = 0
            self._refused = False

        def connection_made(self, transport) -> None:  # type: ignore[override]
            if len(self.connections) >= cap:  # refused before uvicorn counts or sets it up: the cheapest answer
                self._refused = True
                on_refused(503, "connections")
                transport.write(busy)
                transport.close()
                return
            super().connection_made(transport)
            self._arm(limits.head_timeout_s, 408, "head_timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self.transport is not None:  # None: refused in connection_made, never set up
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._refused:
                return
            if self._header_count > limits.max_headers:
                self._refuse(431, "header_count", f"a request may have at most {limits.max_headers} headers")
            elif self._in_head and self._head_bytes > limits.max_head_bytes:
                self._refuse(431, "head_size", f"a request head may be at most {limits.max_head_bytes} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._header_count = True, 0
            if self._timer is None:
                self._arm(limits.head_timeout_s, 408, "head_timeout")

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count <= limits.max_headers:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            if self._header_count > limits.max_headers:
                return  # refused in data_received, once the parser returns
            super().on_headers_complete()
            self._arm(limits.body_timeout_s, 408, "body_timeout")

        def on_body(self, body: bytes) -> None:
            if self._header_count > limits.max_headers:
                return
            super().on_body(body)
            self._arm(limits.body_timeout_s, 408, "body_timeout")

        def on_message_complete(self) -> None:
            if self._header_count > limits.max_headers:
                return
            self._disarm()
            self._in_head = True  # what comes next on this connection is the next request's head
            super().on_message_complete()

        def _arm(self, after_s: float, status: int, reason: str) -> None:
            self._disarm()
            self._deadline = (status, reason)
            self._token += 1
            self._timer = self.loop.call_later(after_s, self._expire, self._token)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._deadline = None

        def _expire(self, token: int) -> None:
            """The deadline passed: queued, not refused here, since thousands of connections opened together
            expire together (one loop turn refusing 2,000 of them stalled /health 0.4-0.5 s)."""
            if not expired:
                self.loop.call_soon(refuse_expired, self.loop)
            expired.append((self, token))

        def _expired(self, token: int) -> None:
            if token == self._token and self._deadline is not None and not self._refused \
                    and not self.transport.is_closing():
                status, reason = self._deadline
                self._refuse(status, reason, "the request did not arrive in time")

        def _refuse(self, status: int, reason: str, message: str) -> None:
            self._refused = True
            self._disarm()
            on_refused(status, reason)
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(_answer(STATUS_LINE[status], message, status))
            self.transport.close()

    return GuardedHttpProtocol


def _answer(status_line: bytes, message: str, status: int) -> bytes:
    """A whole refusal: status line, OpenAI's error envelope, ``Connection: close`` (and ``Retry-After`` on 503)."""
    body = json.dumps(error_body(message, status)).encode()
    head = [status_line, b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n"]
    if status == 503:
        head.append(b"retry-after: 1\r\n")
    return b"".join(head) + b"\r\n" + body
