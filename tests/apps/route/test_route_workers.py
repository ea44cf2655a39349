"""Several routers, no shared state: a session's requests reach the same replica whichever router takes them.

Real processes and real HTTP: stand-in replicas (harness.stub_replica, which name the port that served each
answer) and ``kvtier route`` commands, either two instances on two ports (as behind a load balancer) or one
``--workers 2`` on one port (SO_REUSEPORT)."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from harness.router_load import RouterProc, StubFleet
from harness.serve import WORDS, build_tiny_model
from kvtier.net.ports import free_port


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("route-workers") / "model")


def router(fleet: StubFleet, model: Path, *flags: str) -> RouterProc:
    port = free_port()
    cmd = [sys.executable, "-m", "kvtier", "route", "--port", str(port), "--model", str(model),
           "--log-level", "warning", *flags]
    for url in fleet.urls:
        cmd += ["--replica", url]
    return RouterProc(cmd, port)


def turn(url: str, session: str, n: int) -> int:
    """Send the session's ``n``-th turn over a fresh connection; the port of the replica that served it."""
    system = {"role": "system", "content": " ".join(WORDS) * 4}  # shared, several chunks: routers record where
    messages = [system, *({"role": "user", "content": f"{session} turn {i}"} for i in range(n + 1))]
    answer = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2},
                        headers={"x-session-id": session}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["served_by"]


def test_two_routers_send_a_session_to_the_same_replica(model):
    with StubFleet(4) as fleet, ExitStack() as stack:
        routers = [stack.enter_context(router(fleet, model, "--sessions", "rendezvous")) for _ in range(2)]
        for r in routers:
            r.wait_ready()
        for s in range(3):  # sessions only the first router sees: what each router has seen differs
            turn(routers[0].url, f"only-first-{s}", 0)
        homes = {}
        for s in range(12):
            session = f"conversation-{s}"
            # turns alternate between the routers, and half the sessions start on each: their histories differ
            served = {turn(routers[(n + s) % 2].url, session, n) for n in range(4)}
            assert len(served) == 1, (session, served)
            homes[session] = served.pop()
    assert len(set(homes.values())) >= 2  # sessions spread over the replicas; each stays on its own


def test_workers_share_one_port_and_place_a_session_alike(model):
    with StubFleet(3) as fleet, router(fleet, model, "--workers", "2") as r:
        r.wait_ready()
        children = Path(f"/proc/{r.pid}/task/{r.pid}/children").read_text().split()
        assert len(children) >= 2  # two router processes (and maybe spawn's resource tracker)
        for s in range(4):
            served = {turn(r.url, f"worker-session-{s}", n) for n in range(6)}
            assert len(served) == 1
