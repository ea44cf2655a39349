"""Issue 29, R-3/R-4 on ``kvtier serve``: the HTTP limits ``kvtier route`` enforces hold on a replica too.

A real ``kvtier serve`` process (harness.fleet.ReplicaProcess) with short head and body timeouts set by
its flags, attacked over raw loopback sockets: one huge header value used to stall its event loop, a half-sent
head held a descriptor forever.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from harness.fleet import ReplicaProcess, scrape
from tests.apps.route.test_hostile_router import HEAD, answer

pytestmark = pytest.mark.slow

LIMITS = ("--head-timeout", "1", "--body-timeout", "1", "--max-head-bytes", "16KiB", "--max-headers", "20",
          "--no-events")


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tmp_path_factory) -> Iterator[ReplicaProcess]:
    process = ReplicaProcess(tiny_model_dir, tmp_path_factory.mktemp("serve-limits"), *LIMITS).start()
    try:
        process.wait_healthy(timeout_s=120)
        yield process
    finally:
        process.stop()


def refused(replica: ReplicaProcess, status: int) -> float:
    return scrape(replica.url).get(f'kvtier_server_requests_total{{endpoint="http",status="{status}"}}', 0.0)


def connect(replica: ReplicaProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", replica.port), timeout=20)


def test_oversized_and_half_sent_heads_are_answered_while_health_answers(replica):
    with connect(replica) as big:  # a header value past the cap, its end never sent: refused without waiting
        big.sendall(HEAD + b"X-Big: " + b"b" * (20 << 10))
        assert answer(big) == 431
    with connect(replica) as many:
        many.sendall(HEAD + b"".join(b"X-N%d: 1\r\n" % i for i in range(50)) + b"Content-Length: 2\r\n\r\n{}")
        assert answer(many) == 431
    held = [connect(replica) for _ in range(4)]
    try:
        for s in held:  # half a head each, then nothing
            s.sendall(HEAD[:30])
        health = httpx.get(replica.url + "/health", timeout=10)  # meanwhile, the server answers others
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert [answer(s) for s in held] == [408] * 4  # once the head timeout passed, each is answered, closed
    finally:
        for s in held:
            s.close()
    with connect(replica) as body:  # a whole head, part of the body it declared, then nothing
        body.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
        assert answer(body) == 408
    assert refused(replica, 431) == 2 and refused(replica, 408) == 5
    completion = httpx.post(replica.url + "/v1/completions", json={"prompt": "the cache", "max_tokens": 2},
                            timeout=60)
    assert completion.status_code == 200, completion.text
