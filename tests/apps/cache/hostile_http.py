"""Small hostile or broken HTTP servers on loopback for ``kvtier cache``'s tests: each answers every request the
same way (``Behaviour``), over a real socket, from daemon threads, until ``close``."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable

#: writes an answer (or never finishes one) on the connection; ``stop`` is set at close
Behaviour = Callable[[socket.socket, threading.Event], None]
MIB = 1 << 20


def answer(status: str, body: bytes, content_type: str = "application/json") -> Behaviour:
    def send(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
                     "connection: close\r\n\r\n".encode() + body)
    return send


def endless(declared: int | None = None, piece: int = MIB) -> Behaviour:
    """A 200 JSON answer that never ends: ``piece`` bytes at a time as fast as the client reads, with a
    Content-Length of ``declared`` or none (the body ends when the connection does)."""
    def send(conn: socket.socket, stop: threading.Event) -> None:
        length = f"content-length: {declared}\r\n" if declared is not None else ""
        conn.sendall(f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{length}connection: close\r\n\r\n"
                     .encode() + b'{"pad": "')
        chunk = b"x" * piece
        while not stop.is_set():
            conn.sendall(chunk)
    return send


def drip(every_s: float = 0.2) -> Behaviour:
    """A 200 JSON answer one byte at a time, for ever."""
    def send(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n[")
        while not stop.wait(every_s):
            conn.sendall(b" ")
    return send


def hang(conn: socket.socket, stop: threading.Event) -> None:
    """Reads the request and answers nothing, ever."""
    stop.wait()


class HostileServer:
    """``behaviour`` for every request on ``url`` (a free loopback port)."""

    def __init__(self, behaviour: Behaviour) -> None:
        stop = self.stop = threading.Event()

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                _read_request(self.request)
                try:
                    behaviour(self.request, stop)
                except OSError:  # the client gave up: what these servers are for
                    pass

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _read_request(conn: socket.socket) -> None:
    """The request's head and its body (by Content-Length), so the client is not refused mid-send."""
    conn.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        got = conn.recv(65536)
        if not got:
            return
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    deadline = time.monotonic() + 10
    while len(body) < length and time.monotonic() < deadline:
        got = conn.recv(65536)
        if not got:
            return
        body += got
    conn.settimeout(None)
