"""Load for a router in front of fast stand-in replicas: the replicas, a router process, chat bodies, a client.

* ``StubFleet(n)``: ``n`` ``harness.stub_replica`` processes on free loopback ports (``urls``).
* ``RouterProc(cmd)``: any router command (``kvtier route``, a Rust router) started in a session of its own,
  optionally pinned to cores (``taskset``); ``wait_ready`` polls ``/health`` (or ``/v1/models``).
* ``ChatWorkload``: multi-turn chats that share a system prompt of about ``system_tokens`` tokens, each session
  its own user turns; ``next_body(worker)`` is a session's next request, the one before it plus a new turn.
* ``closed_loop`` / ``open_loop``: an aiohttp client (keep-alive pool) driving a URL; latencies in seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from harness.process import wait_for
from kvtier.net.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
_VOCAB = ["cache", "prefix", "router", "replica", "token", "session", "model", "prompt", "answer", "server", "memory", "disk", "tier", "chunk", "block", "event", "index", "policy", "stream", "request", "latency", "throughput", "question", "context", "document", "system", "user"]


class StubFleet:
    """``n`` stand-in OpenAI replicas (harness.stub_replica), each its own process, optionally pinned."""

    def __init__(self, n: int, cpus: str | None = None, model: str | None = None, blocks: int | None = None,
                 block_ms: float = 0.0) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.model = model  #: what their /v1/models names (None: 404)
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen] = []
        self.blocks = blocks  #: each replica's bounded prefix cache (harness.stub_replica --blocks), None: none
        self.cpus = cpus
        self.block_ms = block_ms  #: with ``blocks``: each answer's delay per block the replica did not hold

    def __enter__(self) -> Self:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for port in self.ports:
            cmd = [sys.executable, "-m", "harness.stub_replica", str(port), *([self.model] if self.model else []),
                   *(["--blocks", str(self.blocks)] if self.blocks else []),
                   *(["--block-ms", str(self.block_ms)] if self.blocks and self.block_ms else [])]
            if self.cpus:
                cmd = ["taskset", "-c", self.cpus, *cmd]
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True))
        for url in self.urls:
            if not wait_for(lambda url=url: _get_ok(url + "/health"), timeout=60):
                raise RuntimeError(f"stand-in replica {url} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            _stop(proc)


class RouterProc:
    """A router command in a session of its own (its workers die with it); ``pid`` for profilers."""

    def __init__(self, cmd: list[str], port: int, log: Path | None = None, cpus: str | None = None) -> None:
        self.cmd = ["taskset", "-c", cpus, *cmd] if cpus else cmd
        self.port, self.log = port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, path: str = "/health", timeout: float = 120.0) -> None:
        assert self.proc is not None
        if not wait_for(lambda: self.proc.poll() is not None or _get_ok(self.url + path), timeout=timeout):
            raise RuntimeError(f"router {self.cmd[:4]} did not answer {path}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"router {self.cmd[:4]} exited with {self.proc.returncode}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            _stop(self.proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class ChatWorkload:
    """Chats sharing one system prompt (about ``system_tokens`` tokens); each session grows by a user turn and an
    answer per request, and after ``turns`` requests a worker starts a new session."""

    system_tokens: int = 2000
    turns: int = 8
    turn_words: int = 40
    seed: int = 0
    model: str = "stand-in"
    _system: str = field(init=False)
    _state: dict[int, tuple[str, list[dict[str, str]]]] = field(init=False, default_factory=dict)
    _sessions: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self._system = " ".join(rng.choice(_VOCAB) for _ in range(self.system_tokens))  # ~1 token a word

    def next_body(self, worker: int) -> tuple[str, bytes]:
        """(session id, request body) of ``worker``'s next request."""
        session, messages = self._state.get(worker, ("", []))
        if not messages or len(messages) >= 1 + 2 * self.turns:
            self._sessions += 1
            session, messages = f"s{self.seed}-{self._sessions}", [{"role": "system", "content": self._system}]
        else:
            messages = [*messages, {"role": "assistant", "content": f"answer {len(messages)} to {session}"}]
        rng = random.Random(f"{session}/{len(messages)}")
        turn = f"{session}: " + " ".join(rng.choice(_VOCAB) for _ in range(self.turn_words))
        messages = [*messages, {"role": "user", "content": turn}]
        self._state[worker] = (session, messages)
        body = {"model": self.model, "messages": messages, "max_tokens": 8, "user": session}
        return session, json.dumps(body).encode()


@dataclass
class LoadResult:
    sent: int
    ok: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds > 0 else 0.0

    def quantile(self, q: float) -> float:
        lat = sorted(self.latencies)
        return lat[min(int(q * len(lat)), len(lat) - 1)] if lat else float("inf")


async def closed_loop(url: str, workload: ChatWorkload, concurrency: int, seconds: float,
                      path: str = "/v1/chat/completions") -> LoadResult:
    """``concurrency`` workers, each sending its next request as soon as its last one was answered."""
    import aiohttp

    latencies: list[float] = []
    counts = [0, 0]
    end = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as client:
        async def worker(i: int) -> None:
            while time.perf_counter() < end:
                _, body = workload.next_body(i)
                latency = await _send(client, url + path, body)
                counts[0] += 1
                if latency is not None:
                    counts[1] += 1
                    latencies.append(latency)

        start = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        took = time.perf_counter() - start
    return LoadResult(counts[0], counts[1], took, latencies)


async def open_loop(url: str, workload: ChatWorkload, rate: float, seconds: float, sessions: int = 64,
                    path: str = "/v1/chat/completions", seed: int = 0) -> LoadResult:
    """Poisson arrivals at ``rate`` per second for ``seconds``, each request a session's next (``sessions``
    sessions taking turns); a request's latency counts from its scheduled arrival, so a router that falls
    behind is charged the queueing it causes."""
    import aiohttp

    rng = random.Random(seed)
    latencies: list[float] = []
    tasks: list[asyncio.Task] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as client:
        start = time.perf_counter()
        due, n = start, 0
        while due < start + seconds:
            due += rng.expovariate(rate)
            _, body = workload.next_body(n % sessions)
            n += 1
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_timed_from(client, url + path, body, due, latencies)))
        await asyncio.gather(*tasks)
        took = time.perf_counter() - start
    return LoadResult(len(tasks), len(latencies), took, latencies)


async def _timed_from(client, url: str, body: bytes, due: float, latencies: list[float]) -> None:
    if await _send(client, url, body) is not None:
        latencies.append(time.perf_counter() - due)


async def _send(client, url: str, body: bytes) -> float | None:
    import aiohttp

    started = time.perf_counter()
    try:
        async with client.post(url, data=body, headers={"content-type": "application/json"}) as answer:
            await answer.read()
            return time.perf_counter() - started if answer.status == 200 else None
    except aiohttp.ClientError:
        return None
