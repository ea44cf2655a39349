"""R-2's memory (hostile round three): rounds of three concurrent 8 MB prompts through a real ``kvtier route``
process must not leave it bigger each round.

The router decodes and tokenizes such a prompt on worker threads, whose glibc arenas kept the freed pages: one
round took it from 436 MB idle to 864, five more to 1,060, still rising. ``kvtier.web.heap`` trims the heap after
large requests; RSS is read from /proc (a memory bound, not a time): after each round it must come back within
150 MB of idle.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness.fleet import ROOT
from harness.process import wait_for
from harness.serve import build_tiny_model
from kvtier.net.ports import free_port

pytestmark = pytest.mark.slow

ROUNDS = 6
GROWTH_LIMIT_MB = 150  # over idle; before the trim: +390 after the first round, and rising


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """``python -m ARGS`` with ``{port}`` in ARGS replaced by a free port, once it answers /health."""
    port = free_port()
    out = open(log, "wb")  # noqa: SIM115 - the process writes it until it is stopped
    args = [a.replace("{port}", str(port)) for a in args]
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    url = f"http://127.0.0.1:{port}"
    assert wait_for(lambda: proc.poll() is None and _up(url), 120), log.read_text()[-2000:]
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_rounds_of_8mb_prompts_leave_the_router_no_bigger(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    replica = router = None
    try:
        replica, replica_url = _start(["harness.stub_replica", "{port}"], tmp_path / "replica.log")
        router, url = _start(["kvtier", "route", "--replica", replica_url, "--model", str(model),
                              "--port", "{port}", "--log-level", "warning"], tmp_path / "router.log")
        body = json.dumps({"prompt": ("word " * 1_600_000)[:7_900_000], "max_tokens": 1}).encode()

        def one(_: int) -> int:
            return httpx.post(url + "/v1/completions", content=body, timeout=600,
                              headers={"content-type": "application/json"}).status_code

        idle = _rss_mb(router.pid)  # started, tokenizer loaded, no request yet
        levels: list[int] = []
        with ThreadPoolExecutor(3) as pool:
            for _ in range(ROUNDS):
                assert set(pool.map(one, range(3))) == {200}
                # back within the limit of idle after each round (at once, or once its trim has run)
                back = wait_for(lambda: _rss_mb(router.pid) < idle + GROWTH_LIMIT_MB, 30, interval=0.5)
                levels.append(_rss_mb(router.pid))
                assert back, f"router RSS idle {idle} MB, after each round: {levels}"
    finally:
        for proc in (router, replica):
            if proc is not None:
                _stop(proc)
