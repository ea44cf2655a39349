"""Runs one workload against one target: times each request, bounds concurrency, advances the target's row
of the live display (progress.py).

The server's own ``/metrics`` are scraped before and after, so per-tier cache hits
(``kvtier_hit_tokens_total{tier=...}``) are reported as the run's difference when the target exposes them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.apps.bench.client import RequestResult, Target, scrape, send, served_model
from kvtier.apps.bench.progress import TargetRow
from kvtier.web.http_limits import CLIENT_KEEPALIVE_S


@dataclass
class RunResult:
    """All requests of one workload against one target, with the wall time and the metric differences."""

    target: str
    workload: str
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    metrics_delta: dict[str, float] = field(default_factory=dict)


class Runner:
    """Sends requests for a workload; ``request`` is what workloads call."""

    def __init__(self, client: httpx.AsyncClient, target: Target, model: str, limit: asyncio.Semaphore,
                 progress: TargetRow) -> None:
        self.client = client
        self.target = target
        self.model = model
        self.limit = limit
        self.progress = progress
        self.t0 = time.perf_counter()
        self.results: list[RequestResult] = []

    async def request(self, path: str, body: dict[str, Any], *, workload: str, round: int, user: int,
                      bounded: bool = True) -> RequestResult:
        """Send one request (waiting for a concurrency slot unless ``bounded`` is False) and record it."""
        result = RequestResult(self.target.label, workload, round, user)
        body = {"model": self.model, **body}
        if bounded:
            async with self.limit:
                await send(self.client, self.target, path, body, result, self.t0)
        else:
            await send(self.client, self.target, path, body, result, self.t0)
        self.results.append(result)
        self.progress.advance(result.ttft_s, result.cached_tokens)
        return result


async def run_workload(target: Target, workload: str, run: Callable[[Runner], Awaitable[None]], row: TargetRow,
                       concurrency: int = 1, timeout_s: float = 600.0,
                       limit: asyncio.Semaphore | None = None) -> RunResult:
    """Run ``run(runner)`` against ``target``, advancing ``row`` per request, and collect its RunResult.

    ``limit`` (shared between runs that go on at once) replaces the run's own ``concurrency`` bound.
    """
    async with bench_client(concurrency, timeout_s) as client:
        model = await served_model(client, target)
        before = await scrape(client, target)
        limit = limit if limit is not None else asyncio.Semaphore(max(1, concurrency))
        runner = Runner(client, target, model, limit, row)
        await run(runner)
        wall = time.perf_counter() - runner.t0
        after = await scrape(client, target)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()
             if k.startswith(("kvtier_hit_tokens_total", "kvtier_miss_tokens_total", "kvtier_stored_tokens_total"))
             and v != before.get(k, 0.0)}
    return RunResult(target.label, workload, runner.results, wall, delta)


def bench_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    """The HTTP client of one run: a pool sized for ``concurrency``, idle connections dropped before a server
    would close them (``CLIENT_KEEPALIVE_S``)."""
    limits = httpx.Limits(max_connections=max(64, concurrency * 2), keepalive_expiry=CLIENT_KEEPALIVE_S)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits)


async def wait_ready(target: Target, timeout_s: float) -> None:
    """Poll ``/v1/models`` until the endpoint answers (raises TimeoutError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            try:
                await served_model(client, target)
                return
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{target.url} did not answer within {timeout_s:.0f} s") from None
                await asyncio.sleep(0.5)
