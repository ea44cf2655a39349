"""A benchmark told to stop (SIGTERM, as a CI runner or ``timeout`` sends) stops the processes it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A benchmark in miniature: a child in a session of its own (as the fleet benchmarks start replicas, routers and
# stores), stopped by the ``with`` block that started it.
SCRIPT = """
import os, signal, subprocess, sys, time
from contextlib import ExitStack
sys.path.insert(0, {benchmarks!r})
from _util import stop_children_on_signal
if {install}:
    stop_children_on_signal()
with ExitStack() as stack:
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    stack.callback(lambda: (os.killpg(child.pid, signal.SIGKILL), child.wait()))
    print(child.pid, flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _child_after_signal(install: bool, sig: int = signal.SIGTERM) -> tuple[int, int]:
    code = SCRIPT.format(benchmarks=str(ROOT / "benchmarks"), install=install)
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(bench.stdout.readline())
    assert _alive(child)
    bench.send_signal(sig)
    return child, bench.wait(timeout=30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_unwinds_the_benchmark_and_stops_its_children(sig):
    child, rc = _child_after_signal(install=True, sig=sig)
    assert rc == 128 + sig
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_without_it_the_child_outlives_the_benchmark():
    child, rc = _child_after_signal(install=False)
    try:
        assert rc == -signal.SIGTERM
        assert _alive(child)  # what the helper is for: the default SIGTERM unwinds nothing
    finally:
        os.kill(child, signal.SIGKILL)
