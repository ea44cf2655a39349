"""DeadlineCalls: blocking calls that a caller waits on only until its deadline (any callable will do)."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.tiers.mooncake.calls import CallNotStarted, CallTimedOut, DeadlineCalls
from harness.process import wait_for


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


def test_on_end_gets_every_finished_call_with_its_times_late_ones_too():
    calls = DeadlineCalls(2, "t")
    ended: list = []
    assert calls.run(lambda: "quick", deadline=time.monotonic() + 5, on_end=ended.append) == "quick"
    assert wait_for(lambda: len(ended) == 1)
    assert ended[0].submitted <= ended[0].started <= ended[0].ended and ended[0].result == "quick"
    release = threading.Event()
    with pytest.raises(CallTimedOut):
        calls.run(lambda: release.wait(10), deadline=time.monotonic() + 0.1, on_end=ended.append)
    assert len(ended) == 1  # still running
    release.set()
    assert wait_for(lambda: len(ended) == 2) and ended[1].late and ended[1].ended >= ended[1].started
    with pytest.raises(KeyError):  # a call that raised ends too
        calls.run({}.__getitem__, "missing", deadline=time.monotonic() + 5, on_end=ended.append)
    assert wait_for(lambda: len(ended) == 3) and isinstance(ended[2].error, KeyError)
    assert calls.close(wait_s=5)
