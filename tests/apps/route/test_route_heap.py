"""R-2's memory (hostile round three): rounds of three concurrent 8 MB prompts through a real ``kvtier route``
process must not leave it bigger each round.

The router decodes and tokenizes such a prompt on worker threads, whose glibc arenas kept the freed pages: one
round took it from 436 MB idle to 864, five more to 1,060, still rising. ``kvtier.web.heap`` trims the heap after
large requests; RSS is read from /proc (a memory bound, not a time): after each round it must come back within
``GROWTH_LIMIT_MB`` of idle.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness.process import wait_for
from harness.router_load import RouterProc, StubFleet
from harness.serve import build_tiny_model
from kvtier.net.ports import free_port

pytestmark = pytest.mark.slow

ROUNDS = 6
GROWTH_LIMIT_MB = 200  # over idle; before the trim: +390 after the first round, and rising (+163 seen once, with it)


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def test_rounds_of_8mb_prompts_leave_the_router_no_bigger(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    port = free_port()
    with StubFleet(1) as fleet, RouterProc([sys.executable, "-m", "kvtier", "route", "--replica", fleet.urls[0],
                                            "--model", str(model), "--port", str(port), "--log-level", "warning"],
                                           port, log=tmp_path / "router.log") as router:
        router.wait_ready()
        body = json.dumps({"prompt": ("word " * 1_600_000)[:7_900_000], "max_tokens": 1}).encode()

        def one(_: int) -> int:
            return httpx.post(router.url + "/v1/completions", content=body, timeout=600,
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
