"""Attacks a hostile client and a hanging replica made on ``kvtier route`` (issue 29, R-1 to R-7), each over real
sockets: the router on uvicorn in this process, its replicas real processes (harness.stub_replica).

Every one of them used to cost the router something before it was refused or served: a 500 nobody counted,
32 MiB bodies and whole prompts tokenized, unbounded session ids shared across tenants, an answer buffered
whole, a request waiting out the read timeout on a replica already ejected, or a socket held open forever.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from kvtier.apps.route.config import HealthConfig, ProxyConfig, RouterConfig
from kvtier.net.ports import free_port
from harness.fleet import ROOT, LiveRouter, scrape
from harness.serve import build_tiny_model
from harness.malformed import MALFORMED_JSON

pytestmark = pytest.mark.slow


class StubReplica:
    """harness.stub_replica in its own process on a free loopback port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.stub_replica", str(self.port)], cwd=ROOT,
                                     env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, "the stub replica died"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the stub replica did not come up"
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("router-hostile") / "model")


@pytest.fixture(scope="module")
def stubs():
    replicas = [StubReplica(), StubReplica()]
    try:
        for replica in replicas:
            replica.wait_healthy()
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


@contextmanager
def router(model: Path, stubs: list[StubReplica], **changes):
    config = RouterConfig(tuple(r.url for r in stubs),
                          health=HealthConfig(interval_s=0.3, timeout_s=1.0, eject_after=1, readmit_after=1))
    with LiveRouter(replace(config, **changes), model) as live, \
            httpx.Client(base_url=live.url, timeout=30) as client:
        yield live, client


def errors_counted(live: LiveRouter, status: int) -> float:
    return sum(v for k, v in scrape(live.url).items()
               if k.startswith("kvtier_router_requests_total") and f'status="{status}"' in k)


def routed(live: LiveRouter) -> float:
    return sum(v for k, v in scrape(live.url).items() if k.startswith("kvtier_router_routed_total"))


# -- one body parser with kvtier serve; every error counted -------------------------------------------------
def test_r1_malformed_bodies_get_the_replicas_400_from_the_router_and_are_counted(model, stubs):
    cases = [(p.values[0], p.values[1]) for p in MALFORMED_JSON]  # the very bodies kvtier serve answers 400
    with router(model, stubs) as (live, client):
        for path, body in cases:
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400, (body[:60], response.text[:300])
            assert "not valid JSON" in response.json()["error"]["message"]
        for ids in ([1 << 64], [1 << 32], [-1]):
            response = client.post("/v1/completions", json={"prompt": ids})
            assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
        assert errors_counted(live, 400) == len(cases) + 3
        assert errors_counted(live, 500) == 0 and routed(live) == 0


def test_r1_header_bytes_that_are_not_ascii_pass_through_untouched(model, stubs):
    raw = b"caf\xe9 \xff"
    with router(model, stubs) as (live, client):
        for headers in ({"x-echo": raw}, {"x-echo": raw, "authorization": b"Bearer k\xe9y"},
                        {"x-echo": raw, "x-session-id": b"s\xe9ssion"}):
            response = client.post("/v1/completions", json={"prompt": "the cache"}, headers=headers)
            assert response.status_code == 200, response.text
            assert bytes.fromhex(response.json()["echo"]) == raw
        assert errors_counted(live, 500) == 0


# -- a replica's body cap, bounded tokenization off the event loop ---------------------------------------------
def test_r2_the_router_caps_bodies_at_what_a_replica_accepts(model, stubs):
    body = json.dumps({"prompt": "x" * (9 << 20)}).encode()  # over the replicas' 8 MiB, under the old 32 MiB
    with router(model, stubs) as (live, client):
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 413, response.text[:300]
        assert errors_counted(live, 413) == 1 and routed(live) == 0


def test_r2_a_huge_prompt_is_tokenized_a_bounded_prefix_off_the_event_loop(model, stubs, monkeypatch):
    huge = "the cache keeps a prefix " * 120_000  # 3 MB of text: about 600 k tokens
    with router(model, stubs, proxy=ProxyConfig(max_prompt_tokens=1024)) as (live, client):
        tokenizer, seen = live.router.tokenizer._tokenizer, []
        real_encode = tokenizer.encode

        def encode(text, *args, **kwargs):
            seen.append((len(text), threading.current_thread()))
            return real_encode(text, *args, **kwargs)

        monkeypatch.setattr(tokenizer, "encode", encode)
        for path, body in (("/v1/completions", {"prompt": huge}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})):
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text[:300]  # the replica judges its own context
        limit = live.router.config.proxy.max_prompt_tokens
        assert seen and max(n for n, _ in seen) <= 32 * limit  # a bounded prefix, never the whole text
        assert live.thread not in {t for _, t in seen}  # the event loop's thread never tokenized


# -- sticky sessions bounded and per tenant ----------------------------------------------------------------
def test_r5_sticky_sessions_are_bounded_and_kept_per_tenant(model, stubs):
    from kvtier.apps.route.config import default_routing

    routing = replace(default_routing(), max_sessions=8)
    with router(model, stubs, routing=routing) as (live, client):
        homes = live.router.policy._homes
        huge = client.post("/v1/completions", json={"prompt": "the cache", "user": "u" * (1 << 20)})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "user", huge.text[:300]
        huge = client.post("/v1/completions", json={"prompt": "the cache"}, headers={"x-session-id": "s" * 4096})
        assert huge.status_code == 400, huge.text[:300]
        assert len(homes) == 0
        for key in ("tenant-a", "tenant-b"):
            response = client.post("/v1/completions", json={"prompt": "the cache", "user": "alice"},
                                   headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 200
        assert len(homes) == 2  # one alice per tenant, never the same entry
        for i in range(20):
            client.post("/v1/completions", json={"prompt": "the cache", "user": f"user-{i}"})
        assert len(homes) == 8
        assert errors_counted(live, 400) == 2


# -- non-streamed answers pass through as they arrive ----------------------------------------------------
def test_r6_a_non_streamed_answer_reaches_the_client_before_the_replica_finishes_it(model, stubs):
    with router(model, stubs) as (live, client):
        timeout = httpx.Timeout(30, read=15)  # the stub finishes its answer only after 60 s
        with client.stream("POST", "/v1/completions", json={"prompt": "HOLD"}, timeout=timeout) as response:
            assert response.status_code == 200
            first = next(response.iter_raw())
        assert first.startswith(b'{"id": "cmpl-held"')
        live.wait(lambda: sum(r.in_flight for r in live.router.replicas) == 0, what="the router to let go")


# -- a request queued on a replica that is ejected goes elsewhere ------------------------------------------
def test_r7_a_request_waiting_on_a_replica_that_is_ejected_is_retried_elsewhere(model, stubs):
    with router(model, stubs) as (live, client):
        first = client.post("/v1/completions", json={"prompt": "the cache"}, headers={"x-session-id": "r7"})
        home = next(r for r in stubs if r.name == first.headers["x-kvtier-replica"])
        other = next(r for r in stubs if r is not home)
        home.proc.send_signal(signal.SIGSTOP)  # it accepts connections and answers nothing, health checks neither
        try:
            second = client.post("/v1/completions", json={"prompt": "the cache"}, headers={"x-session-id": "r7"})
        finally:
            home.proc.send_signal(signal.SIGCONT)
        assert second.status_code == 200 and second.headers["x-kvtier-replica"] == other.name
        retried = f'kvtier_router_retries_total{{cause="failed",replica="{home.name}"}}'
        assert scrape(live.url).get(retried, 0) >= 1  # it was sent to the stopped replica first
        live.wait(lambda: all(r.up for r in live.router.replicas), what="readmission")


# -- head size and count, head and body timeouts, a connection cap --------------------------------------
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: kvtier\r\nContent-Type: application/json\r\n"


def answer(sock: socket.socket) -> int:
    """The status of the one answer ``sock`` gets before the router closes it."""
    data = b""
    while True:
        more = sock.recv(65536)
        if not more:
            break
        data += more
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split()[1])


def test_r3_r4_heads_and_bodies_that_never_end_and_too_many_connections_are_answered_and_closed(model, stubs):
    from kvtier.web.http_limits import HttpLimits

    limits = HttpLimits(max_head_bytes=16 << 10, max_headers=20, head_timeout_s=1.0, body_timeout_s=1.0,
                        max_connections=8)
    with router(model, stubs, http=limits) as (live, client):
        def connect() -> socket.socket:
            return socket.create_connection(("127.0.0.1", live.port), timeout=20)

        with connect() as s:  # a header value past the cap, its end never sent: refused without waiting for it
            s.sendall(HEAD + b"X-Big: " + b"b" * (20 << 10))  # (sent whole: bytes unread at close would reset)
            assert answer(s) == 431
        with connect() as s:
            s.sendall(HEAD + b"".join(b"X-N%d: 1\r\n" % i for i in range(50)) + b"Content-Length: 2\r\n\r\n{}")
            assert answer(s) == 431
        with connect() as s:  # half a head, then nothing
            s.sendall(HEAD[:30])
            assert answer(s) == 408
        with connect() as s:  # a whole head, a tenth of the body it declared, then nothing
            s.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
            assert answer(s) == 408
        held = [connect() for _ in range(8)]  # as many half-sent heads as the cap allows
        try:
            for s in held:
                s.sendall(HEAD[:30])
            with connect() as s:
                assert answer(s) == 503  # one more: answered and closed at once, no descriptor kept
            assert [answer(s) for s in held] == [408] * 8  # then the head timeout frees them all
        finally:
            for s in held:
                s.close()
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json={"prompt": "the cache"}).status_code == 200
        assert errors_counted(live, 431) == 2 and errors_counted(live, 408) == 10 and errors_counted(live, 503) == 1
