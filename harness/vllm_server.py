"""vLLM's real OpenAI-compatible server as a subprocess, started the way the README says: ``kvtier vllm serve``
(vLLM's own ``vllm serve``, on any build of vLLM), with or without the kvtier connector.

``ServerPair`` starts two such servers side by side with the same model and flags, vLLM alone and vLLM with
kvtier over a memory and a disk tier, to compare their greedy outputs and restart the kvtier one over its disk.

Used by tests/integrations/test_vllm_serve.py, test_vllm_inputs_serve.py, test_vllm_images_serve.py and
benchmarks/vllm_serve.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

from harness.process import ServerProcess
from kvtier.net.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM then serves /reset_prefix_cache


def kv_transfer_config(extra: dict) -> dict:
    """The ``--kv-transfer-config`` of the README, with ``extra`` as ``kv_connector_extra_config``."""
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


class VllmServer(ServerProcess):
    """``python -m kvtier vllm serve MODEL --port PORT ARGS`` (plus ``--kv-transfer-config`` when ``kvtier``
    is given), its output in ``log``. ``env`` adds to the environment (VLLM_CPU_KVCACHE_SPACE defaults to 1)."""

    def __init__(self, model: str, port: int, log: Path, *, kvtier: dict | None = None,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.model, self.port, self.log = model, port, log
        self.kvtier, self.args = kvtier, args
        self.env = {"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvtier", "vllm", "serve", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        if self.kvtier is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(self.kvtier))]
        return cmd

    def launch(self) -> VllmServer:
        """Start the process without waiting (several servers can start side by side); then ``wait_ready``."""
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        with open(self.log, "wb") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 900.0) -> VllmServer:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited during start:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.5)
        raise RuntimeError(f"vLLM server did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def start(self) -> VllmServer:
        return self.launch().wait_ready()

    def stop(self) -> None:
        """SIGINT to the whole process group (API server, engine core, workers), then SIGKILL if needed."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # workers left behind by a server that died first
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def post(self, path: str, body: dict | None = None, timeout: float = 60.0) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")

    def reset_prefix_cache(self, timeout: float = 60.0) -> None:
        """Empty vLLM's own prefix cache (``/reset_prefix_cache``, served with VLLM_SERVER_DEV_MODE=1). It fails
        while blocks are held, e.g. by kvtier saves still copying: retried until it succeeds."""
        end = time.monotonic() + timeout
        while not self.post("/reset_prefix_cache").get("success"):
            if time.monotonic() > end:
                raise RuntimeError("vLLM's prefix cache could not be reset")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """The ``vllm:kvtier_*`` samples of ``/metrics``, labels reduced to ``tier``: ``name{tier}`` -> value
        (summed over the other labels)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return parse_kvtier_metrics(text)

    def hit_tokens(self) -> float:
        """Tokens kvtier loaded into this server (``kvtier_hit_tokens_total``), from memory and disk."""
        metrics = self.metrics()
        return metrics.get("kvtier_hit_tokens_total{memory}", 0.0) + metrics.get("kvtier_hit_tokens_total{disk}", 0.0)

    def preemptions(self) -> float:
        """vLLM's ``vllm:num_preemptions_total``, summed over its labels."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            lines = resp.read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_preemptions_total"))


class ServerPair:
    """vLLM alone (``plain``) and vLLM with ``KVTierConnector`` (``kvtier``) over a memory tier and a disk tier
    under ``tmp/disk-tier`` (chunks of ``chunk_size`` tokens), both serving ``model`` with ``args`` and
    VLLM_SERVER_DEV_MODE=1 (for ``/reset_prefix_cache``), logs in ``tmp``. ``with`` starts both side by side
    and stops both, even when one fails to start."""

    def __init__(self, model: Path, tmp: Path, args: tuple[str, ...], chunk_size: int) -> None:
        self.model, self.tmp, self.args, self.chunk_size = model, tmp, args, chunk_size
        self.plain = VllmServer(str(model), free_port(), tmp / "plain.log", args=args, env=DEV_MODE)
        self.kvtier = self._kvtier_server("kvtier.log")

    def _kvtier_server(self, log: str) -> VllmServer:
        disk = {"kind": "disk", "path": str(self.tmp / "disk-tier"), "capacity_bytes": "1GiB",
                "admission": "always"}
        config = {"chunk_size": self.chunk_size, "tiers": [{"kind": "memory", "capacity_bytes": "512MiB"}, disk]}
        return VllmServer(str(self.model), free_port(), self.tmp / log, kvtier=config, args=self.args, env=DEV_MODE)

    def __enter__(self) -> Self:
        try:
            for server in (self.plain, self.kvtier):
                server.launch()
            for server in (self.plain, self.kvtier):
                server.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.plain.stop()
        self.kvtier.stop()

    def restart_kvtier(self) -> VllmServer:
        """Stop the kvtier server and start a new one over the same disk tier (its memory tier starts empty)."""
        self.kvtier.stop()
        self.kvtier = self._kvtier_server("kvtier-restarted.log").start()
        return self.kvtier


def parse_kvtier_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:kvtier_") or "_created" in line.split(" ", 1)[0]:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0].removeprefix("vllm:")
        tier = ""
        if 'tier="' in series:
            tier = series.split('tier="', 1)[1].split('"', 1)[0]
        key = f"{name}{{{tier}}}" if tier else name
        out[key] = out.get(key, 0.0) + float(value)
    return out
