"""``--record-chunk-tokens``: the tokens per key of the router's own record of what it sent to replicas that
publish no events. A shared prefix shorter than one record chunk is invisible to the router; a finer chunk sees
it. Real processes: stand-in replicas (harness.stub_replica) and a ``kvtier route``."""

from __future__ import annotations

import sys

import httpx

from harness.router_load import RouterProc, StubFleet
from kvtier.integrations.models import ensure_smollm2
from kvtier.net.ports import free_port

STEMS = [f"Topic number {i} is discussed here at length: " + " ".join(f"w{i}x{j}" for j in range(20))
         for i in range(6)]


def _served(router: RouterProc, prompt: str) -> int:
    answer = httpx.post(router.url + "/v1/completions", timeout=60,
                        json={"model": "m", "prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return answer.json()["served_by"]


def test_a_finer_record_chunk_sends_a_short_shared_prefix_back_to_its_replica() -> None:
    model = ensure_smollm2()
    with StubFleet(2) as fleet:
        port = free_port()
        cmd = [sys.executable, "-m", "kvtier", "route", "--model", str(model), "--port", str(port),
               "--log-level", "warning", "--policy", "prefix", "--record-chunk-tokens", "16",
               *[a for url in fleet.urls for a in ("--replica", url)]]
        with RouterProc(cmd, port) as router:
            router.wait_ready()
            first = {stem: _served(router, stem + " first ending") for stem in STEMS}
            assert len(set(first.values())) == 2  # the stems were spread over both replicas
            for stem, replica in first.items():  # each stem is ~100 tokens: several 16-token chunks, no 256 one
                assert _served(router, stem + " a different ending altogether") == replica
