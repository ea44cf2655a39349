"""The vLLM rank's admin/metrics server answers ``GET /health`` (kvtier.integrations.vllm.admin), in a process of
its own (tests.integrations.rank_server) over a real socket: 200 and a small JSON while its long-lived kvtier
threads live; 503 naming the one that died once one has (kvtier.base.threads), as ``kvtier serve`` answers, the
rest of the server still serving."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
KEY = "rank-admin-key"


def test_health_is_ok_until_a_watched_thread_dies_then_503_naming_it() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tests.integrations.rank_server", KEY, "--dying-thread"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        r = httpx.get(url + "/health", timeout=30)
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "ok", "model": "tiny@main"}

        proc.stdin.write(b"die\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 60  # a bound for a thread that never dies, not a speed
        while (r := httpx.get(url + "/health", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "/health never saw the thread die"
            time.sleep(0.1)
        assert r.status_code == 503, r.text
        assert r.json() == {"status": "unhealthy", "model": "tiny@main", "dead_threads": ["kvtier-test-worker"]}
        assert httpx.get(url + "/metrics", timeout=30).status_code == 200
        listed = httpx.get(url + "/admin/v1/nonexistent", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert listed.status_code == 404
        assert httpx.get(url + "/nowhere", timeout=30).json()["error"]["message"].count("/health") == 1
    finally:
        proc.kill()
        proc.wait()
