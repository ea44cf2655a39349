"""Small helpers shared by the benchmarks: timing, the RESULT line, a `kvtier route` process, and stopping what a
benchmark started when it is told to stop."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtier.apps.calibrate.measure import timed  # noqa: F401  (re-exported: every benchmark times with it)


def best(values: list[float]) -> float:
    """The fastest repetition: on a shared machine interference only ever adds time."""
    return min(values)


def median(values: list[float]) -> float:
    return statistics.median(values)


def result(figures: dict[str, float]) -> None:
    """Print the one closing line every benchmark ends with."""
    print("RESULT " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


def stop_children_on_signal() -> None:
    """Make SIGTERM and SIGHUP end the benchmark as Ctrl-C does: ``SystemExit`` in the main thread, so every
    ``with`` block unwinds and stops the replicas, routers and stores it started (they run in sessions of their own
    and would outlive a benchmark killed outright). A second signal during that clean-up is ignored."""

    def stop(signum, _frame):
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (root only); False where the kernel refuses."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def evict_page_cache(folder: str | Path) -> str:
    """Drop the page cache (root), else evict ``folder``'s files from it (posix_fadvise DONTNEED, which any
    user may do for files they can open); says which."""
    if drop_caches():
        return "drop_caches"
    for root, _dirs, files in os.walk(folder):
        for file in files:
            try:
                fd = os.open(os.path.join(root, file), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
    return "fadvise"


def plain_write(path: str, parts: Iterable[bytes | memoryview]) -> float:
    """Seconds to write ``parts`` sequentially to one new file with a single fsync: the disk's write limit."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in parts:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def plain_read(path: str, block: int) -> float:
    """Seconds to read a file sequentially into one reused ``block``-sized buffer: the disk's read limit."""
    buf = bytearray(block)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
    return time.perf_counter() - start


@contextmanager
def router_process(cmd: list[str], url: str, log_path: Path) -> Iterator[str]:
    """``kvtier route`` started with ``cmd`` (its output to ``log_path``); yields ``url`` once its ``/health``
    answers, stops it on exit."""
    import httpx

    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvtier route exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("kvtier route did not come up")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def routed_per_replica(url: str) -> dict[str, int]:
    """Requests each replica served (the router's counts, every reason together)."""
    import httpx

    out: dict[str, int] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvtier_router_routed_total{"):
            series, _, value = line.rpartition(" ")
            replica = series.partition('replica="')[2].partition('"')[0]
            out[replica] = out.get(replica, 0) + int(float(value))
    return out
