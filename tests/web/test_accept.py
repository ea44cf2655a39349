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
