"""``kvtier.web.accept``: a uvicorn server that accepts a bounded number of connections per event-loop turn
(issue 48: uvloop set up every waiting connection in one turn, so a flood of them held the router's loop)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvtier.web import accept

CLIENTS = 200


def _health(_request) -> PlainTextResponse:
    return PlainTextResponse("ok")


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(accept, "ACCEPTS_PER_TURN", 8)
    sock = accept.listening_socket("127.0.0.1", 0)
    config = uvicorn.Config(Starlette(routes=[Route("/health", _health)]), loop="uvloop", log_level="warning")
    srv = accept.paced_server(config, sock)
    srv.accepted_per_call = []
    real_accept = srv._accept

    def counting_accept() -> None:
        before = len(srv.server_state.connections) + len(srv._pending)
        real_accept()
        srv.accepted_per_call.append(len(srv.server_state.connections) + len(srv._pending) - before)

    srv._accept = counting_accept  # the reader the server adds at startup is this one
    yield srv, sock
    srv.should_exit = True


def _start(srv) -> threading.Thread:
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started
    return thread


def test_waiting_connections_are_accepted_a_bounded_number_per_turn_and_all_served(server):
    srv, sock = server
    port = sock.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(CLIENTS)]  # queued by the kernel
    for client in clients:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    thread = _start(srv)
    answers = []
    for client in clients:
        client.settimeout(30)
        data = b""
        while chunk := client.recv(4096):
            data += chunk
        answers.append(data.split(b"\r\n", 1)[0])
        client.close()
    assert answers == [b"HTTP/1.1 200 OK"] * CLIENTS
    calls = srv.accepted_per_call
    assert max(calls) == 8  # 200 were waiting: the first turns took 8 each, never more
    srv.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert sock.fileno() == -1  # closed at shutdown: the port is free again


def test_a_connection_gone_before_it_is_set_up_costs_nothing_and_serving_goes_on(server):
    srv, sock = server
    port = sock.getsockname()[1]
    gone = socket.create_connection(("127.0.0.1", port))
    gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset on close
    gone.close()
    thread = _start(srv)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 200 OK")
    srv.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_connection_beyond_the_cap_is_answered_503_at_the_accept_and_the_open_ones_are_kept():
    from kvtier.web.http_limits import HttpLimits, guarded_protocol

    refusals = []
    sock = accept.listening_socket("127.0.0.1", 0)
    protocol = guarded_protocol(HttpLimits(max_connections=4), lambda status, reason: refusals.append((status, reason)))
    config = uvicorn.Config(Starlette(routes=[Route("/health", _health)]), loop="uvloop", log_level="warning",
                            http=protocol)
    srv = accept.paced_server(config, sock)
    thread = _start(srv)
    port = sock.getsockname()[1]
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
    deadline = time.monotonic() + 30
    while len(srv.server_state.connections) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(srv.server_state.connections) == 4
    with socket.create_connection(("127.0.0.1", port), timeout=30) as extra:
        answer = b""
        while chunk := extra.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer
    assert refusals == [(503, "connections")]
    assert len(srv.server_state.connections) == 4  # the held ones are still served
    held[0].sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert held[0].recv(4096).startswith(b"HTTP/1.1 200 OK")
    for client in held:
        client.close()
    srv.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()



def test_a_connection_accepted_while_another_finishes_its_setup_is_not_refused_below_the_cap():
    """A connection is made (in ``connections``) a turn or two before its setup task ends: the acceptor once
    counted it twice then (made and still pending), so a second connection arriving in between was refused 503
    with only one of two allowed connections open. Here the first one's setup is held until the second arrives."""
    from kvtier.web.http_limits import HttpLimits, guarded_protocol

    refusals = []
    arrived = threading.Event()
    guarded = guarded_protocol(HttpLimits(max_connections=2), lambda status, reason: refusals.append((status, reason)))

    class FirstSetupHeld(guarded):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) == 1:
                arrived.wait(30)  # the loop stops here, made but its task unfinished, until the second connects

    sock = accept.listening_socket("127.0.0.1", 0)
    config = uvicorn.Config(Starlette(routes=[Route("/health", _health)]), loop="uvloop", log_level="warning",
                            http=FirstSetupHeld)
    srv = accept.paced_server(config, sock)
    thread = _start(srv)
    port = sock.getsockname()[1]
    first = socket.create_connection(("127.0.0.1", port), timeout=30)
    deadline = time.monotonic() + 30
    while not srv.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.001)
    second = socket.create_connection(("127.0.0.1", port), timeout=30)  # completed by the kernel, not yet accepted
    arrived.set()
    deadline = time.monotonic() + 30
    while len(srv.server_state.connections) < 2 and not refusals and time.monotonic() < deadline:
        time.sleep(0.01)
    assert refusals == []
    assert len(srv.server_state.connections) == 2
    second.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert second.recv(4096).startswith(b"HTTP/1.1 200 OK")
    first.close()
    second.close()
    srv.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_on_started_runs_after_the_lifespan_and_before_the_first_connection_is_accepted():
    """``kvtier route`` freezes its startup objects there: everything loaded by then, nothing served yet."""
    from contextlib import asynccontextmanager

    seen = []

    @asynccontextmanager
    async def lifespan(_app):
        seen.append("lifespan")
        yield

    sock = accept.listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    early = socket.create_connection(("127.0.0.1", port), timeout=30)  # waiting in the kernel's queue already
    early.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    config = uvicorn.Config(Starlette(routes=[Route("/health", _health)], lifespan=lifespan), loop="uvloop",
                            log_level="warning")
    srv = accept.paced_server(config, sock,
                              on_started=lambda: seen.append(("started", len(srv.server_state.connections))))
    thread = _start(srv)
    assert early.recv(4096).startswith(b"HTTP/1.1 200 OK")
    assert seen == ["lifespan", ("started", 0)]
    early.close()
    srv.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()
