"""A compromised replica floods ``kvtier route``'s event subscriber with big batches (a real ZMQ publisher in its
own process, tests.apps.route.flood_replica; the router a real ``kvtier route`` process): the router's /health
keeps answering every probe during the flood, since a batch is applied a bounded number of events per event-loop
turn, and every event of the flood ends up in the router's index all the same."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from kvtier.net.ports import free_port
from tests.apps.route.fleet import ROOT, scrape
from tests.apps.serve.conftest import build_tiny_model

pytestmark = pytest.mark.slow

BATCHES, PER_BATCH = 4, 300_000  # a batch near the subscriber's 16 MiB message cap: ~1 s of work in one piece
PROBE_BOUND_S = 2.0  #: generous: a probe waits on at most a few slices of a batch, never on a whole one


def start(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_for(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"{url} died"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up"
        time.sleep(0.2)


def series(url: str, name: str, replica: str, **labels: str) -> float:
    want = [f'replica="{replica}"', *(f'{k}="{v}"' for k, v in labels.items())]
    return sum(v for k, v in scrape(url).items() if k.startswith(name + "{") and all(w in k for w in want))


def test_health_answers_during_a_flood_of_big_batches_and_every_event_is_applied(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    replica_port, router_port = free_port(), free_port()
    replica_url, router_url = f"http://127.0.0.1:{replica_port}", f"http://127.0.0.1:{router_port}"
    name = f"127.0.0.1:{replica_port}"
    with open(tmp_path / "replica.log", "wb") as rlog, open(tmp_path / "router.log", "wb") as log:
        replica = start(["-m", "tests.apps.route.flood_replica", str(replica_port), str(BATCHES), str(PER_BATCH)],
                        rlog)
        router = None
        try:
            wait_for(replica_url + "/health", replica)
            router = start(["-m", "kvtier", "route", "--replica", replica_url, "--port", str(router_port),
                            "--model", str(model), "--log-level", "warning"], log)
            wait_for(router_url + "/health", router)
            deadline = time.monotonic() + 120
            while series(router_url, "kvtier_router_events_total", name, what="snapshot") < 1:
                assert time.monotonic() < deadline, "the router never followed the replica's stream"
                time.sleep(0.2)

            assert httpx.post(replica_url + "/flood", timeout=10).status_code == 200
            total, probes, held = BATCHES * PER_BATCH, [], 0.0
            deadline = time.monotonic() + 600  # a bound for a flood that is never applied, not a speed
            while held < total:
                assert time.monotonic() < deadline, f"the index holds {held} of {total} keys"
                began = time.monotonic()
                r = httpx.get(router_url + "/health", timeout=30)
                probes.append(time.monotonic() - began)
                assert r.status_code == 200, r.text
                if len(probes) % 10 == 0:
                    held = series(router_url, "kvtier_router_index_chunks", name, tier="memory")
                time.sleep(0.05)
            sent = httpx.get(replica_url + "/flood", timeout=10).json()
        finally:
            for proc in (router, replica):
                if proc is not None:
                    proc.terminate()
                    proc.wait(timeout=30)
    print(f"E-3 flood: {len(probes)} /health probes, slowest {max(probes):.3f} s, median "
          f"{sorted(probes)[len(probes) // 2]:.3f} s")
    assert sent == {"sent": total, "total": total}
    assert held == total
    assert max(probes) < PROBE_BOUND_S, f"slowest /health {max(probes):.2f} s of {len(probes)} probes"
    assert len(probes) >= 10
