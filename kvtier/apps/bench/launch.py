"""Start ``kvtier serve`` processes on free loopback ports for a bench run, and always stop them.

Used by ``kvtier bench --serve`` and the benchmarks: a server with kvtier and the same server without it,
each a real process, so the two compare under the same conditions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from kvtier.apps.bench.client import Target
from kvtier.net.ports import free_port


class ServeProcess:
    """One ``kvtier serve`` process on a free loopback port, its output in ``<log_dir>/serve-<label>.log``;
    ``src`` runs another checkout's kvtier instead of the one imported here (e.g. to compare with main)."""

    def __init__(self, label: str, args: Sequence[str], log_dir: Path, src: Path | None = None) -> None:
        port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"serve-{label}.log"
        self.target = Target(label, f"http://127.0.0.1:{port}")
        cmd = [sys.executable, "-m", "kvtier", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", *args]
        env = os.environ.copy() if src is None else {**os.environ, "PYTHONPATH": str(src)}
        with open(self.log_path, "wb") as log:  # `-m` imports from the working directory first: run in src
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=src)

    def wait_healthy(self, timeout_s: float) -> Target:
        _wait_healthy(self.proc, self.target, self.log_path, timeout_s)
        return self.target

    def stop(self) -> None:
        _stop(self.proc)


@contextmanager
def serve_processes(specs: Sequence[tuple[str, Sequence[str]]], log_dir: Path, startup_timeout_s: float = 300.0
                    ) -> Iterator[list[Target]]:
    """Start ``kvtier serve`` for each ``(label, args)`` at once; yield their Targets once all are healthy;
    stop every process on exit, whatever happened."""
    with ExitStack() as stack:
        procs = []
        for label, args in specs:
            proc = ServeProcess(label, args, log_dir)
            stack.callback(proc.stop)
            procs.append(proc)
        yield [proc.wait_healthy(startup_timeout_s) for proc in procs]


def _wait_healthy(proc: subprocess.Popen, target: Target, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"kvtier serve ({target.label}) exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(target.url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"kvtier serve ({target.label}) not healthy after {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cache_on_and_off(serve_args: Sequence[str], log_dir: Path):
    """Two servers from the same ``serve_args``: ``kvtier`` (cache on) and ``no-cache`` (``--no-cache``)."""
    return serve_processes([("kvtier", serve_args), ("no-cache", [*serve_args, "--no-cache"])], log_dir)
