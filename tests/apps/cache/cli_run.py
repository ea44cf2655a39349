"""``kvtier cache`` run as a user runs it: its own process, real HTTP; what it printed, its exit code and its
peak memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str
    max_rss_mib: float  #: the process's peak resident memory

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


def kvtier_cache(*args: str, key: str | None = "admin-key", limit_s: float = 120.0) -> Ran:
    """``python -m kvtier cache ARGS`` with ``key`` as KVTIER_ADMIN_KEY; killed (and the test failed) past
    ``limit_s``, a bound for a command that would otherwise never end, not a measure of speed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVTIER_ADMIN_KEY", None)
    if key is not None:
        env["KVTIER_ADMIN_KEY"] = key
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier", "cache", *args], stdout=out, stderr=err, env=env,
                                cwd=ROOT)
        deadline = time.monotonic() + limit_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.send_signal(signal.SIGKILL)
                os.wait4(proc.pid, 0)
                raise AssertionError(f"kvtier cache {' '.join(args)} still ran after {limit_s} s")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        return Ran(proc.returncode, out.read().decode(), err.read().decode(), usage.ru_maxrss / 1024)
