"""``kvtier.web.startup``: what the servers do once loaded (issue 29: no full collection over startup objects;
issue 48: the router's loop thread gets the GIL back from its snapshot worker within 1 ms)."""

from __future__ import annotations

import gc
import sys

from kvtier.web.startup import LOOP_SWITCH_INTERVAL_S, favour_event_loop, freeze_startup_objects


def test_objects_alive_at_startup_are_frozen_out_of_the_cyclic_gc():
    gc.unfreeze()
    try:
        kept = [{"startup": i} for i in range(1000)]  # tracked containers, as a model's modules are
        freeze_startup_objects()
        assert gc.get_freeze_count() >= len(kept)
        assert not any(gc.is_tracked(k) and k in gc.get_objects(generation=2) for k in kept[:10])
    finally:
        gc.unfreeze()


def test_favour_event_loop_lets_the_loop_thread_take_the_gil_back_within_a_millisecond():
    before = sys.getswitchinterval()
    try:
        favour_event_loop()
        assert sys.getswitchinterval() == LOOP_SWITCH_INTERVAL_S <= 0.001
    finally:
        sys.setswitchinterval(before)
