"""Accepting connections a bounded number per event-loop turn, for kvtier's uvicorn servers.

uvloop (the loop uvicorn picks when it is installed) accepts every connection waiting on the listening socket in
one loop turn and sets each up there (libuv accepts until the kernel has none left). A flood of connections
therefore holds the loop for as long as it takes to set up all that arrived since the last turn: against
19,488 half-sent heads, ``kvtier route``'s loop ran 160-180 ms of a 200 ms window doing nothing else, and
``/health`` on an open connection waited 100-155 ms. asyncio's own loop bounds this (it accepts ``backlog``
connections a turn), but uvicorn passes one number as both that bound and the kernel's listen backlog.

``paced_server`` runs a ``uvicorn.Server`` whose listening socket is read by this module instead: at most
``ACCEPTS_PER_TURN`` connections are accepted per loop turn, each handed to the loop with
``connect_accepted_socket`` and served by uvicorn's protocol exactly as uvicorn would; the rest wait in the
kernel's queue (``LISTEN_BACKLOG`` deep) for the next turns, while requests on connections already open are
answered in between. Out of descriptors, accepting pauses for a second (as asyncio does) instead of spinning.
A connection beyond the protocol's cap (``http_limits.guarded_protocol``'s ``connection_cap``) is answered its
503 and closed right at the accept, before anything is set up for it (a flood's tens of thousands of refusals
were most of what setting connections up cost).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable
from functools import partial

log = logging.getLogger(__name__)

ACCEPTS_PER_TURN = 64  #: connections accepted per event-loop turn (a few ms of setting up at most)
LISTEN_BACKLOG = 2048  #: connections the kernel queues for the next turns (beyond: SYNs dropped and resent)
OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A non-blocking socket listening on ``host:port`` (``reuse_port``: others may bind it too, ``SO_REUSEPORT``).
    OSError if the address cannot be bound (e.g. taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def paced_server(config, sock: socket.socket, on_started: Callable[[], None] = lambda: None):
    """A ``uvicorn.Server`` for ``config`` serving connections accepted on ``sock`` (``listening_socket``), at most
    ``ACCEPTS_PER_TURN`` per loop turn; ``run()`` it without sockets. It closes ``sock`` when it shuts down.
    ``on_started`` is called once the app, its protocol modules and its lifespan are loaded, before the first
    connection is accepted."""
    import uvicorn

    family, kind, proto = int(sock.family), int(sock.type), sock.proto

    class PacedAcceptServer(uvicorn.Server):
        accepts_per_turn = ACCEPTS_PER_TURN

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=[])  # the lifespan and uvicorn's state; no listening socket of its own
            on_started()
            self._loop = asyncio.get_running_loop()
            self._pending: set[asyncio.Task] = set()
            self._loop.add_reader(sock.fileno(), self._accept)

        def _protocol(self) -> asyncio.Protocol:
            return self.config.http_protocol_class(config=self.config, server_state=self.server_state,
                                                   app_state=self.lifespan.state)

        def _accept(self) -> None:
            protocol = self.config.http_protocol_class
            cap = getattr(protocol, "connection_cap", None)
            for _ in range(self.accepts_per_turn):
                try:
                    fd, _ = sock._accept()  # the bare descriptor: socket.accept() builds enums for every one
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    return
                except OSError as exc:
                    if exc.errno not in OUT_OF_DESCRIPTORS:
                        raise
                    log.warning("out of descriptors accepting a connection (%s); pausing accepts for 1 s", exc)
                    self._loop.remove_reader(sock.fileno())
                    self._loop.call_later(1.0, self._loop.add_reader, sock.fileno(), self._accept)
                    return
                # Only connections already made count: one still being set up may be in ``connections`` already
                # (uvloop calls connection_made a turn before the task ends), so adding ``_pending`` counted it
                # twice and refused connections below the cap. The protocol's own check refuses the few a turn
                # may set up beyond the cap.
                if cap is not None and len(self.server_state.connections) >= cap:
                    protocol.count_refusal(503, "connections")  # counted before the peer can see the answer
                    _refuse(fd, protocol.busy_answer)  # no transport, protocol or task for it: ~10x cheaper
                    continue
                conn = socket.socket(family, kind, proto, fileno=fd)
                conn.setblocking(False)
                task = self._loop.create_task(self._loop.connect_accepted_socket(self._protocol, conn))
                self._pending.add(task)
                task.add_done_callback(partial(self._connected, conn))

        def _connected(self, conn: socket.socket, task: asyncio.Task) -> None:
            self._pending.discard(task)
            if task.cancelled() or task.exception() is not None:  # shut down, or the peer went before it was set up
                conn.close()

        async def shutdown(self, sockets=None) -> None:
            self._loop.remove_reader(sock.fileno())
            sock.close()
            for task in list(self._pending):
                task.cancel()
            await super().shutdown(sockets=sockets)

    return PacedAcceptServer(config)


def _refuse(fd: int, answer: bytes) -> None:
    """Write ``answer`` to the accepted connection ``fd`` (a few hundred bytes: a fresh socket's buffer takes them
    at once, or the peer is gone and they are lost) and close it."""
    try:
        os.write(fd, answer)
    except OSError:
        pass
    finally:
        os.close(fd)
