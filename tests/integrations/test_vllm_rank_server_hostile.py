"""The vLLM rank's admin/metrics server (kvtier.integrations.vllm.admin) against hostile clients (issue 48's
A-1 and P-1), in a process of its own (tests.integrations.rank_server) over real sockets: its threads and
descriptors are counted from /proc.

Before, a deeply nested body answered 500 (msgspec's RecursionError) and every idle connection kept a thread
and a descriptor for ever (1,500 of them: 1,504 threads).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.process import wait_for
from kvtier.integrations.vllm.rank_http import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_WORKERS,
    REQUEST_TIMEOUT_S,
    BoundedHandler,
    RankHTTPServer,
)

ROOT = Path(__file__).resolve().parents[2]
KEY = "rank-admin-key"
FLOOD = 1500


class RankServer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integrations.rank_server", KEY], cwd=ROOT,
                                     stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


@pytest.fixture
def rank() -> Iterator[RankServer]:
    server = RankServer()
    try:
        yield server
    finally:
        server.proc.kill()
        server.proc.wait()


def connect(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


def test_a1_a_deeply_nested_body_is_a_400(rank: RankServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    for body in (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b'{"tokens": [' + b"9" * 5000 + b"]}"):
        r = httpx.post(rank.url + "/admin/v1/lookup", content=body, headers=auth, timeout=30)
        assert r.status_code == 400, r.text[:300]
        assert "not valid JSON" in r.json()["error"]["message"]
    assert httpx.get(rank.url + "/metrics", timeout=30).status_code == 200


class Peaks:
    """The most threads and descriptors ``server`` held at once, sampled from /proc until ``stop``."""

    def __init__(self, server: RankServer) -> None:
        self.threads = self.descriptors = 0
        self._server, self._stop = server, threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.threads = max(self.threads, self._server.threads())
            self.descriptors = max(self.descriptors, self._server.descriptors())

    def stop(self) -> None:
        self._stop.set()
        self._sampler.join()


def test_p1_idle_connections_hold_no_thread_and_are_closed(rank: RankServer) -> None:
    # A peak, not a count at one moment: on a loaded machine the first idle connections may already be closed
    # (IDLE_TIMEOUT_S) before the last ones are accepted, so "all of them at once" is a race, not a property.
    threads, descriptors = rank.threads(), rank.descriptors()
    peaks = Peaks(rank)
    idle = connect(rank.port, FLOOD)
    try:
        assert wait_for(lambda: peaks.descriptors >= descriptors + 100, 30)  # many idle connections held at once
        # the server closes what sends nothing (the clients still hold their ends open)
        assert wait_for(lambda: rank.descriptors() <= descriptors + 5, 10 * IDLE_TIMEOUT_S)
        peaks.stop()
        assert peaks.threads <= threads + 1  # before: one thread per connection (1,500 more)
        assert peaks.descriptors <= descriptors + MAX_CONNECTIONS + 1
        assert httpx.get(rank.url + "/metrics", timeout=30).status_code == 200
    finally:
        peaks.stop()
        for sock in idle:
            sock.close()


class _Silent(BoundedHandler):
    def do_GET(self) -> None:
        self.reply(200, b"ok", "text/plain")


def _capped(max_connections: int, max_workers: int) -> tuple[RankHTTPServer, threading.Thread]:
    server = RankHTTPServer(("127.0.0.1", 0), _Silent, max_connections=max_connections, max_workers=max_workers)
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    return server, loop


def test_p1_at_the_cap_a_new_connection_closes_the_longest_idle_one() -> None:
    server, loop = _capped(8, 2)
    held = connect(server.port, 8)  # idle: each waits (IDLE_TIMEOUT_S) for a request that never comes
    try:
        assert wait_for(lambda: server.evicted == 0 and server.connections == (8, 0), 30)
        # a scrape while the idle flood holds every slot is answered, not refused
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=30).status_code == 200
        assert server.refused == 0 and server.evicted == 1
        held[0].settimeout(30)
        assert held[0].recv(1 << 16) == b""  # the first one accepted was closed, with nothing sent to it
    finally:
        server.shutdown()
        loop.join(30)
        for sock in held:
            sock.close()


def test_p1_when_every_connection_is_being_answered_a_new_one_gets_503_and_is_closed() -> None:
    server, loop = _capped(2, 2)
    slow = connect(server.port, 2)
    extra: list[socket.socket] = []
    try:
        for sock in slow:  # half a head: each holds a worker until REQUEST_TIMEOUT_S
            sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n")
        assert wait_for(lambda: server.connections == (0, 2), 30)
        extra = connect(server.port, 3)
        for sock in extra:
            sock.settimeout(30)
            assert sock.recv(64).startswith(b"HTTP/1.1 503")
            assert wait_for(lambda s=sock: s.recv(1 << 16) == b"", 30)  # then closed by the server
        assert server.refused == 3 and server.evicted == 0
    finally:
        server.shutdown()
        loop.join(30)
        for sock in slow + extra:
            sock.close()


def test_p1_requests_that_never_finish_hold_a_bounded_number_of_threads(rank: RankServer) -> None:
    threads = rank.threads()
    slow = connect(rank.port, 3 * MAX_WORKERS)
    try:
        for sock in slow:  # half a head, then nothing: each connection is a request that never ends
            sock.sendall(b"POST /admin/v1/lookup HTTP/1.1\r\nhost: x\r\n")
        assert wait_for(lambda: rank.threads() >= threads + MAX_WORKERS - 2, 30)
        assert rank.threads() <= threads + MAX_WORKERS
        assert wait_for(lambda: rank.threads() <= threads + 1, 10 * REQUEST_TIMEOUT_S)
        assert httpx.get(rank.url + "/metrics", timeout=30).status_code == 200
    finally:
        for sock in slow:
            sock.close()
