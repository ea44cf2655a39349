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
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.integrations.vllm.rank_http import IDLE_TIMEOUT_S, MAX_CONNECTIONS, MAX_WORKERS, REQUEST_TIMEOUT_S
from tests.harness import wait_for

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


def test_p1_idle_connections_hold_no_thread_and_are_closed(rank: RankServer) -> None:
    threads, descriptors = rank.threads(), rank.descriptors()
    idle = connect(rank.port, FLOOD)
    try:
        assert wait_for(lambda: rank.descriptors() >= descriptors + min(FLOOD, MAX_CONNECTIONS) - 10, 30)
        assert rank.threads() <= threads + 1  # before: one thread per connection (1,500 more)
        assert rank.descriptors() <= descriptors + MAX_CONNECTIONS + 1  # beyond the cap: answered 503, closed
        # the server closes what sends nothing (the clients still hold their ends open)
        assert wait_for(lambda: rank.descriptors() <= descriptors + 5, 10 * IDLE_TIMEOUT_S)
        assert httpx.get(rank.url + "/metrics", timeout=30).status_code == 200
    finally:
        for sock in idle:
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
