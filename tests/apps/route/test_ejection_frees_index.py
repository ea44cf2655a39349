"""Issue 29, E-3: what the router's index knew of a replica is freed when the health checks eject it.

Through the real path: a ``kvtier serve`` process publishing its cache events, the router (in-process uvicorn)
following them, the replica frozen with SIGSTOP until a health check fails and ejects it
(``Health.eject`` -> ``Replica.stop_events`` -> ``FleetIndex.forget``). Before, a hostile replica's millions of
keys stayed in the router's memory after its ejection.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.apps.route.config import HealthConfig, RouterConfig
from kvtier.fleet.index import RECENT
from harness.fleet import LiveRouter, ReplicaProcess, scrape
from harness.serve import WORDS, build_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ejection-model"))


@pytest.fixture(scope="module")
def replica(model, tmp_path_factory) -> Iterator[ReplicaProcess]:
    process = ReplicaProcess(model, tmp_path_factory.mktemp("ejection")).start()
    try:
        process.wait_healthy(timeout_s=120)
        yield process
    finally:
        process.proc.send_signal(signal.SIGCONT)
        process.stop()


def index_series(live: LiveRouter, name: str) -> dict[str, float]:
    return {k: v for k, v in scrape(live.url).items()
            if k.startswith("kvtier_router_index_chunks") and f'replica="{name}"' in k}


def test_an_ejected_replicas_index_entries_are_freed_and_its_snapshot_restores_them(replica, model):
    config = RouterConfig((replica.url,), health=HealthConfig(interval_s=0.3, timeout_s=1.0, eject_after=1,
                                                              readmit_after=1))
    with LiveRouter(config, model) as live, httpx.Client(base_url=live.url, timeout=60) as client:
        index, state = live.router.index, live.router.replicas[0]
        prompt = "eject " + " ".join(WORDS[i % len(WORDS)] for i in range(120))  # several 16-token chunks
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert response.status_code == 200, response.text
        live.wait(lambda: index.chunks(replica.name).get("memory", 0) >= 4, what="the replica's stores reported")
        held = index.chunks(replica.name)["memory"]
        assert index_series(live, replica.name)  # /metrics shows what the index holds of it

        replica.proc.send_signal(signal.SIGSTOP)  # alive but silent: only a health check can tell
        try:
            live.wait(lambda: not state.up, what="ejection by the health check")
            assert index.chunks(replica.name) == {}  # its holdings and the router's own record of it: gone
            assert index.dropped(replica.name) == 0 and RECENT not in index.chunks(replica.name)
            assert index_series(live, replica.name) == {}
            assert live.metric(f'kvtier_router_ejections_total{{cause="active",replica="{replica.name}"}}') >= 1
        finally:
            replica.proc.send_signal(signal.SIGCONT)

        live.wait(lambda: state.up and index.chunks(replica.name).get("memory", 0) >= held,
                  what="readmission and the replica's snapshot")  # what it holds is learnt again, not lost
