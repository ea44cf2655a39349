"""What /proc says about the processes of benchmarks/hostile_fleet.py: RSS, a thread's CPU run and wait, nice.

The niceness check is what keeps the replay honest on a shared machine: every process the benchmark starts that
is not a server (the router, the replicas, R-4's do-nothing control listener) is an attacker standing in for a
client on another host, and must run at ``_hostile_attacks.ATTACKER_NICE`` in every thread; the servers run at
the benchmark's own priority. ``unniced`` names the processes that break that rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return float("nan")


def schedstat_ms(pid: int) -> tuple[float, float]:
    """Of ``pid``'s main thread: ms it has run on a CPU, ms it has waited on a run queue."""
    try:
        with open(f"/proc/{pid}/schedstat") as fh:
            ran, waited, _ = fh.read().split()
        return int(ran) / 1e6, int(waited) / 1e6
    except (OSError, ValueError):
        return float("nan"), float("nan")


def _stat(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name (state first, then ppid ...)."""
    with open(path) as fh:
        return fh.read().rpartition(")")[2].split()


def children() -> dict[int, list[int]]:
    """Every live process's children, by parent pid."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out.setdefault(int(_stat(f"/proc/{entry}/stat")[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def lowest_nice(pid: int) -> int | None:
    """The lowest nice value among ``pid``'s threads (Linux keeps one per thread), None if it is gone."""
    nices = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                nices.append(int(_stat(f"/proc/{pid}/task/{task}/stat")[16]))
            except (OSError, IndexError, ValueError):
                pass
    except OSError:
        return None
    return min(nices, default=None)


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def command(pid: int) -> str:
    args = cmdline(pid).split(b"\0")
    if args == [b""]:
        return "?"
    shown = [a.decode(errors="replace").rsplit("/", 1)[-1] for a in args[1:4] if a]
    return " ".join(shown)[:60]


def unniced(root: int, servers: set[int], nice: int) -> list[str]:
    """The processes under ``root`` (not ``root`` itself, nor ``servers`` and what they start) with a thread below
    ``nice``, each as ``"PID COMMAND (nice N)"``. A child still running ``root``'s own command is a fork between
    ``fork`` and ``exec``, before its ``preexec_fn`` niced it: not an attacker yet, and not reported."""
    tree, out, own = children(), [], cmdline(root)
    todo = list(tree.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in servers or cmdline(pid) == own:
            continue
        todo.extend(tree.get(pid, []))
        low = lowest_nice(pid)
        if low is not None and low < nice:
            out.append(f"{pid} {command(pid)} (nice {low})")
    return out


def background_load(n: int) -> list:
    """``n`` busy processes at nice 19: the 1-minute load average rises by about ``n`` (the issue measures at
    >= 4), as on a machine shared with batch jobs, while taking almost no CPU from the servers (a nice-19
    process weighs 15 against a nice-0 one's 1024). The caller stops them (``stop_load``)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19))
            for _ in range(n)]


def stop_load(burners: list) -> None:
    """Kill and reap the processes of ``background_load``."""
    for burner in burners:
        burner.kill()
        burner.wait()


def await_load(n: int, timeout_s: float = 180.0) -> float:
    """Wait until the 1-minute load average reaches ``n`` (it climbs over about a minute once
    ``background_load`` runs), at most ``timeout_s``; the load average then. So the first rows are measured at
    the load asked for, not while it rises."""
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] < n and time.monotonic() < deadline:
        time.sleep(1.0)
    return os.getloadavg()[0]
