"""How late the router's event loop wakes while a worker thread prepares a replica's snapshot (E-3's flood).

``kvtier route`` prepares a snapshot of a replica's keys (``ReplicaHoldings.prepare``: the keys decoded in pieces
and put into key shards, about a second of Python for 2 M keys) in a worker thread, so the event loop stays free.
Free, but not first: after each wait for I/O the loop thread needs the GIL back, and CPython lets the worker keep
it for the switch interval. This runs a real uvloop event loop that sleeps 10 ms at a time while a worker prepares
the 2.5 M-key snapshot of E-3 (capped at 2 M keys) twice, and reports how much later than asked each sleep ended,
at CPython's default switch interval (5 ms) and at the router's (``kvtier.web.startup.LOOP_SWITCH_INTERVAL_S``),
the two interleaved, ``--rounds`` times each.

    PYTHONPATH=. python benchmarks/loop_wake.py [--quick] [--rounds 3]

Prints lateness p50/p99/max per setting and the ratio default / router at p50 and p99 (target: at least 2x at
p50); last line RESULT {json}.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import threading
import time
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _util import result  # noqa: E402

from kvtier.core.events import TierHolding  # noqa: E402
from kvtier.events.wire import decode_snapshot_head, encode_snapshot  # noqa: E402
from kvtier.fleet.index import ReplicaHoldings, SharedStores  # noqa: E402
from kvtier.web.startup import LOOP_SWITCH_INTERVAL_S  # noqa: E402

DEFAULT_SWITCH_INTERVAL_S = 0.005  #: CPython's own
SLEEP_S = 0.010


def lateness_ms(payload: bytes, cap: int, switch_interval_s: float) -> list[float]:
    """ms each 10 ms sleep of an event loop overran while a thread prepared ``payload`` twice."""
    sys.setswitchinterval(switch_interval_s)
    holdings = ReplicaHoldings(SharedStores(60.0, cap), max_keys=cap)
    prepared = []

    def prepare_twice() -> None:
        for _ in range(2):
            prepared.append(holdings.prepare(decode_snapshot_head(payload)))

    async def watch() -> list[float]:
        worker = threading.Thread(target=prepare_twice)
        worker.start()
        late = []
        while worker.is_alive():
            start = time.perf_counter()
            await asyncio.sleep(SLEEP_S)
            late.append((time.perf_counter() - start - SLEEP_S) * 1000)
        worker.join()
        if len(prepared) != 2:
            raise RuntimeError("the worker thread failed to prepare the snapshot (its traceback is above)")
        return late

    try:
        return uvloop.run(watch())
    finally:
        sys.setswitchinterval(DEFAULT_SWITCH_INTERVAL_S)


def summary(late: list[float]) -> dict[str, float]:
    late = sorted(late)
    return {"p50_ms": round(statistics.median(late), 2), "p99_ms": round(late[int(0.99 * (len(late) - 1))], 2),
            "max_ms": round(late[-1], 2), "wakes": len(late)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a 250k-key snapshot: a smoke run")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    n_keys, cap = (250_000, 200_000) if args.quick else (2_500_000, 2_000_000)
    keys = [hashlib.sha256(b"%d" % i).digest() for i in range(n_keys)]
    payload = encode_snapshot("e", 0, [TierHolding("memory", keys)])
    settings = {"default": DEFAULT_SWITCH_INTERVAL_S, "router": LOOP_SWITCH_INTERVAL_S}
    late: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, interval in settings.items():
            late[name] += lateness_ms(payload, cap, interval)
    figures: dict = {"quick": args.quick, "snapshot_keys": n_keys}
    for name, interval in settings.items():
        figures[name] = {"switch_interval_ms": interval * 1000, **summary(late[name])}
        print(f"{name:8s} switch interval {interval * 1000:.0f} ms: late p50 {figures[name]['p50_ms']} ms, "
              f"p99 {figures[name]['p99_ms']} ms, max {figures[name]['max_ms']} ms ({figures[name]['wakes']} wakes)")
    for q in ("p50_ms", "p99_ms"):
        figures[f"default_over_router_{q[:3]}"] = round(figures["default"][q] / max(figures["router"][q], 1e-3), 2)
    figures["target_met"] = figures["default_over_router_p50"] >= 2.0
    print(f"default / router: p50 {figures['default_over_router_p50']}x, p99 {figures['default_over_router_p99']}x "
          f"(target at p50: at least 2x)")
    result(figures)


if __name__ == "__main__":
    main()
