"""Real replicas and a real router for the router's tests: ``kvtier serve`` processes on fixed loopback ports
(so one can be killed and restarted where it was) and ``kvtier route``'s app on uvicorn in a thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvtier.net.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


class ReplicaProcess:
    """``kvtier serve`` on a tiny model; ``start()`` again after ``stop()`` restarts it on the same port."""

    def __init__(self, model: Path, log_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"127.0.0.1:{self.port}"
        self.args = ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                     "--chunk-size", "16", "--memory-bytes", "32MiB", "--threads", "1", "--max-tokens", "8",
                     "--log-level", "warning", *extra]
        self.log = log_dir / f"replica-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ReplicaProcess:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvtier", *self.args], stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return self

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/kvtier/info", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"replica on {self.port} did not come up: {self.log}"
            time.sleep(0.3)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def metric(self, series: str) -> float:
        """One series of the replica's /metrics, e.g. ``kvtier_server_requests_total{endpoint="chat",...}``."""
        return scrape(self.url).get(series, 0.0)


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


class LiveRouter:
    """The router's app on uvicorn in a background thread; ``url`` is its base URL, ``router`` the service."""

    def __init__(self, config, model: Path) -> None:
        import uvicorn

        from kvtier.apps.route.app import server_config
        from kvtier.apps.route.service import Router
        from kvtier.integrations.prompts import PromptTokenizer

        self.router = Router(config, PromptTokenizer(model))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(server_config(self.router, "127.0.0.1", self.port, "warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveRouter:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the router did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def metric(self, series: str) -> float:
        return scrape(self.url).get(series, 0.0)

    def wait(self, predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)
