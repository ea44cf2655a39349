"""What a kvtier server does once it has loaded everything, before it serves its first request."""

from __future__ import annotations

import gc
import sys


def freeze_startup_objects() -> None:
    """Put every object alive now out of the cyclic garbage collector's reach (``gc.freeze``).

    What a server loads at start (the model, the tokenizer, every imported module: ~380k tracked objects in
    ``kvtier route``) lives as long as the process, yet each full collection walks all of it: 430-520 ms
    with the event loop stopped on this 2-core machine. A flood of connections or events is what triggers
    full collections, so the stall came exactly when a server was attacked. Frozen, a full collection walks
    only what was allocated since. Startup garbage is collected first, so nothing that is garbage is frozen.
    """
    gc.collect()
    gc.freeze()


#: how long a thread may hold the GIL while another waits for it, in a server whose event loop shares the process
#: with busy worker threads (CPython's default: 5 ms)
LOOP_SWITCH_INTERVAL_S = 0.001


def favour_event_loop() -> None:
    """Let the event-loop thread take the GIL back from a busy worker thread within ``LOOP_SWITCH_INTERVAL_S``.

    ``kvtier route`` prepares a replica's snapshot (up to 2 M keys, about a second of Python) in a worker thread,
    off the loop. The loop thread still needs the GIL back after every wait for I/O, and CPython lets the worker
    keep it for the switch interval first (5 ms by default), so each loop turn of a request woke late by about
    that, and a request handled over several turns paid it on each while a flooding replica's snapshots were
    prepared. With 1 ms the loop wakes about 4x sooner (``benchmarks/loop_wake.py``; figures in the docs'
    hostile-input benchmark page); the worker's work takes slightly longer instead.
    """
    sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)
