"""``kvtier.web.startup``: what the servers do once loaded (issue 29: no full collection over startup objects)."""

from __future__ import annotations

import gc

from kvtier.web.startup import freeze_startup_objects


def test_objects_alive_at_startup_are_frozen_out_of_the_cyclic_gc():
    gc.unfreeze()
    try:
        kept = [{"startup": i} for i in range(1000)]  # tracked containers, as a model's modules are
        freeze_startup_objects()
        assert gc.get_freeze_count() >= len(kept)
        assert not any(gc.is_tracked(k) and k in gc.get_objects(generation=2) for k in kept[:10])
    finally:
        gc.unfreeze()
