"""Attacks on the admin surfaces of ``kvtier route`` and ``kvtier serve`` (issue 48's A-1 to A-3), all real
processes over real sockets: a ``kvtier serve`` replica, a hostile stand-in replica
(harness.hostile_admin) and a ``kvtier route`` in front of both.

Each used to cost a 500, a leaked key, gigabytes of the router's memory or an admin call that never ended.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvtier.net.ports import free_port
from harness.fleet import ROOT, ReplicaProcess
from harness.serve import build_tiny_model

pytestmark = pytest.mark.slow

ADMIN = "fleet-admin-key"
DEADLINE_S = 3.0  # the router's --admin-timeout here
DEEP = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_up(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up: {log}"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def all_up(fleet: Fleet, timeout_s: float = 60.0) -> None:
    """Until the router has both replicas up (on a loaded machine a slow health probe may eject one a while)."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = httpx.get(fleet.router_url + "/health", timeout=10).json()["replicas"]
        if all(r["state"] == "up" for r in replicas):
            return
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@dataclass
class Fleet:
    serve: ReplicaProcess
    hostile_url: str
    hostile_name: str
    router_url: str
    router: subprocess.Popen


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("hostile-admin")
    model = build_tiny_model(base / "model")
    (base / "admin.key").write_text(ADMIN + "\n")
    serve = ReplicaProcess(model, base, "--admin-key-file", str(base / "admin.key"))
    hostile_port, router_port = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    try:
        serve.start()
        procs.append(_start(["harness.hostile_admin", str(hostile_port)], base / "hostile.log"))
        hostile_url = f"http://127.0.0.1:{hostile_port}"
        procs.append(_start(["kvtier", "route", "--replica", serve.url, "--replica", hostile_url, "--port",
                             str(router_port), "--model", str(model), "--events-key", str(base / "events.key"),
                             "--admin-timeout", str(DEADLINE_S), "--health-interval", "0.5",
                             "--log-level", "warning"], base / "router.log"))
        serve.wait_healthy()
        _wait_up(procs[0], hostile_url + "/health", base / "hostile.log")
        router_url = f"http://127.0.0.1:{router_port}"
        _wait_up(procs[1], router_url + "/health", base / "router.log")
        yield Fleet(serve, hostile_url, f"127.0.0.1:{hostile_port}", router_url, procs[1])
    finally:
        for proc in procs:
            _stop(proc)
        serve.stop()


def test_a1_a_deeply_nested_admin_body_is_a_400_from_the_replica_and_the_router(fleet: Fleet) -> None:
    auth = {"Authorization": f"Bearer {ADMIN}", "content-type": "application/json"}
    digits = b'{"tokens": [' + b"9" * 5000 + b"]}"
    for url in (fleet.serve.url, fleet.router_url):
        for body in (DEEP, digits):
            r = httpx.post(url + "/admin/v1/lookup", content=body, headers=auth, timeout=60)
            assert r.status_code == 400, (url, r.status_code, r.text[:300])
            assert "not valid JSON" in r.json()["error"]["message"]


def test_a2_authorization_bytes_reach_the_replicas_as_sent_and_no_key_is_echoed(fleet: Fleet) -> None:
    raw = b"Bearer k\xe9y-\xff"
    all_up(fleet)
    r = httpx.post(fleet.router_url + "/admin/v1/lookup", json={"text": "hello"}, headers={"authorization": raw},
                   timeout=60)
    assert r.status_code == 200, r.text[:500]
    assert bytes.fromhex(r.json()["replicas"][fleet.hostile_name]["body"]["authorization"]) == raw
    padded = f"Bearer {ADMIN}   ".encode()  # whitespace around a header's value is no part of it
    all_up(fleet)
    status, answer = post_raw_header(fleet.router_url, "/admin/v1/lookup", b'{"text": "hello"}', padded)
    assert status == 200, answer[:500]
    assert json.loads(answer)["replicas"][fleet.serve.name]["status"] == 200, answer  # it took the admin key
    assert ADMIN.encode() not in answer


def test_a2_on_completions_a_padded_key_is_served_and_ejects_no_replica(fleet: Fleet) -> None:
    all_up(fleet)
    body = b'{"prompt": "the cache keeps a prefix", "max_tokens": 2}'
    for _ in range(4):  # before: h11 refused to send it, each replica's "failure" counted towards its ejection
        status, answer = post_raw_header(fleet.router_url, "/v1/completions", body, b"Bearer alice-key  ")
        assert status == 200, answer[:500]
    replicas = httpx.get(fleet.router_url + "/health", timeout=10).json()["replicas"]
    assert all(r["state"] == "up" for r in replicas), replicas
    status, answer = post_raw_header(fleet.router_url, "/v1/completions", body, b"Bearer alice\x01key")
    assert status in (400, 401) and b"alice" not in answer, answer[:500]


def post_raw_header(url: str, path: str, body: bytes, authorization: bytes) -> tuple[int, bytes]:
    """POST with an Authorization header httpx would refuse to send (http.client sends any bytes but CR/LF)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest("POST", path)
        conn.putheader(b"authorization", authorization)
        conn.putheader(b"content-type", b"application/json")
        conn.putheader(b"content-length", str(len(body)).encode())
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("mode", ["huge", "drip", "hang", "deep", "digits", "mistyped"])
def test_a3_a_hostile_replicas_answer_is_its_own_error_within_the_deadline(fleet: Fleet, mode: str) -> None:
    all_up(fleet)
    before = rss_mb(fleet.router.pid)
    start = time.monotonic()
    r = httpx.post(fleet.router_url + "/admin/v1/lookup", json={"text": mode},
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    took = time.monotonic() - start
    assert r.status_code == 200, r.text[:500]
    merged = r.json()
    assert merged["replicas"][fleet.hostile_name]["status"] is None
    assert merged["replicas"][fleet.hostile_name]["error"]
    assert merged["replicas"][fleet.serve.name]["status"] == 200
    assert merged["best"]["replica"] == fleet.serve.name
    assert took < 25  # the deadline is 3 s; before, a dripping or hung replica held the call for ever
    assert rss_mb(fleet.router.pid) - before < 200  # before: a 1 GiB answer took the router to 6.6 GB
    assert httpx.get(fleet.router_url + "/health", timeout=10).status_code == 200
