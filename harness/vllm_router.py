"""The vLLM project's Rust router, ``vllm-router --policy kv_aware``, as a subprocess in front of real vLLM
servers, fed by their KV events (each replica's ZMQ PUB and replay sockets, as ``--kv-event-source`` and
``--kv-event-replay-source``).

It does not tokenize: it asks the replica's ``/v1/chat/completions/render`` for the prompt's token ids, which
vLLM serves only with ``--enable-scale-out`` (403 otherwise, and the router then routes by load alone). It
indexes only blocks of ``--kv-event-block-size`` tokens, so kvtier's connector publishes its chunks in blocks
of that size (``event_block_size``).

The binary comes from a venv of its own, made by scripts/router-peers-venv.sh (which ``scripts/setup.sh test``
runs): ``KVTIER_ROUTER_PEERS`` names it, else the script's default (/work/venvs/routers where /work/venvs
exists, else .venv-routers in the checkout). Used by benchmarks/vllm_fleet.py, benchmarks/router_scale.py and
tests/integrations/test_vllm_router_kv.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

from harness.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("KVTIER_ROUTER_PEERS") or (
    "/work/venvs/routers" if Path("/work/venvs").is_dir() else ROOT / ".venv-routers"))
#: the router's debug line for each decision: the worker it chose and the prefix tokens it credited there
DECISION = re.compile(r'KV prefix decision .*?worker="([^"]+)" input_tokens=(\d+) new_prefill_tokens=(\d+) '
                      r'credited_prefix_tokens=(\d+)')
SELECTED = re.compile(r'KV request selected attempt=0 worker_url="([^"]+)"')
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def binary() -> Path | None:
    """The ``vllm-router`` executable, or None where it is not installed."""
    path = PEERS / "bin" / "vllm-router"
    return path if path.exists() else None


class VllmRouter(ServerProcess):
    """``vllm-router --policy kv_aware`` on ``port`` in front of ``workers``: (OpenAI URL, events endpoint,
    replay endpoint or None) each; ``model`` the served model name; blocks of ``block_size`` tokens. Its metrics are on
    ``metrics_port``; its log (debug level: one ``KV prefix decision`` line per request) in ``log``."""

    def __init__(self, workers: list[tuple[str, str, str]], model: str, block_size: int, port: int,
                 metrics_port: int, log: Path, extra: tuple[str, ...] = ()) -> None:
        self.workers, self.model, self.block_size = workers, model, block_size
        self.port, self.metrics_port, self.log, self.extra = port, metrics_port, log, extra
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        exe = binary()
        if exe is None:
            raise RuntimeError(f"no vllm-router under {PEERS} (scripts/router-peers-venv.sh; KVTIER_ROUTER_PEERS)")
        cmd = [str(exe), "--host", "127.0.0.1", "--port", str(self.port), "--policy", "kv_aware",
               "--kv-event-block-size", str(self.block_size), "--kv-event-model", self.model,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
               "--log-level", "debug", *self.extra, "--worker-urls", *[url for url, _, _ in self.workers]]
        for url, events, replay in self.workers:
            cmd += ["--kv-event-source", f"{url}={events}"]
            if replay:
                cmd += ["--kv-event-replay-source", f"{url}={replay}"]
        return cmd

    def start(self, timeout: float = 120.0) -> Self:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm-router did not answer within {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None

    def metrics(self) -> dict[str, float]:
        """Its Prometheus samples, ``name{labels}`` -> value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                out[series] = float(value)
        return out

    def routed(self) -> dict[str, int]:
        """Requests it sent to each worker (by URL) so far: its ``KV request selected`` log lines of first
        attempts (its Prometheus counters carry no per-worker request count in this mode)."""
        out: dict[str, int] = {}
        for worker in SELECTED.findall(ANSI.sub("", self.log.read_text(errors="replace"))):
            out[worker] = out.get(worker, 0) + 1
        return out

    def decisions(self) -> list[tuple[str, int, int]]:
        """Every routing decision in its log so far: (worker URL, prompt tokens, prefix tokens credited there)."""
        text = ANSI.sub("", self.log.read_text(errors="replace"))
        return [(m[1], int(m[2]), int(m[4])) for m in DECISION.finditer(text)]
