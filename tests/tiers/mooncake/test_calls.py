"""DeadlineCalls: blocking calls that a caller waits on only until its deadline (any callable will do)."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.tiers.mooncake.calls import CallNotStarted, CallTimedOut, DeadlineCalls


def test_result_exception_and_deadline():
    calls = DeadlineCalls(2, "t")
    assert calls.run(lambda a, b: a + b, 2, 3, deadline=time.monotonic() + 5) == 5
    with pytest.raises(KeyError):
        calls.run({}.__getitem__, "missing", deadline=time.monotonic() + 5)
    release = threading.Event()
    late: list[object] = []
    start = time.monotonic()
    with pytest.raises(CallTimedOut):
        calls.run(lambda: release.wait(10) and "done", deadline=start + 0.2, on_late=late.append)
    assert time.monotonic() - start < 5.0  # the caller left at its deadline (a hang guard, not a timing) ...
    assert late == []
    release.set()  # ... and the call, when it ends, hands its result to on_late
    assert calls.close(wait_s=5) and late == ["done"]


def test_busy_workers_fail_fast_and_close_refuses_new_calls():
    calls = DeadlineCalls(1, "t")
    release = threading.Event()
    with pytest.raises(CallTimedOut):
        calls.run(release.wait, 10, deadline=time.monotonic() + 0.1)
    start = time.monotonic()
    ran: list[int] = []
    # the only worker is still stuck: no waiting beyond the deadline, and the call never runs (so it is not a
    # CallTimedOut, after which the caller would leave its buffers to a call that never comes)
    with pytest.raises(CallNotStarted):
        calls.run(ran.append, 1, deadline=start + 0.2)
    assert time.monotonic() - start < 5.0  # a hang guard, not a timing
    assert not calls.close(wait_s=0.1)  # a call is still inside
    release.set()
    with pytest.raises(CallNotStarted):
        calls.run(ran.append, 2, deadline=time.monotonic() + 5)
    assert calls.close(wait_s=5) and ran == []
