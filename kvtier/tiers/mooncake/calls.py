"""Blocking engine calls that a caller waits on only until its deadline.

Mooncake's Python calls block in C++ (with the GIL released), and its own timeouts are coarse: an RPC to a hung
master or a transfer to a frozen peer gives up after 30 s, and joining a pool whose master is down takes
90 s. So each call runs on one of a few daemon worker threads and the caller waits for a worker and for the
result only until its deadline. A call that misses the deadline keeps running on its worker until the engine
gives up; its ``on_late`` callback then receives the outcome, which is where the caller's buffers are released,
never while the engine may still write them. Daemon threads: a call stuck in the engine never holds up the
interpreter's exit.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any, Generic, TypeVar

from kvtier.base.errors import TierError

log = logging.getLogger(__name__)
T = TypeVar("T")


class CallTimedOut(TierError):
    """The deadline passed before the call returned; the call goes on and ends on its worker (``on_late``).
    ``ran_s``: the seconds it had on its worker before the deadline (less than its caller's budget when the
    caller queued for this process's buffer or transfer turns first)."""

    def __init__(self, message: str, ran_s: float = float("inf")) -> None:
        super().__init__(message)
        self.ran_s = ran_s


class CallNotStarted(TierError):
    """The call never started (no worker or turn was free before the deadline, or the calls are closed): no
    engine call holds the caller's buffers, so the caller releases them itself."""


class Pending(Generic[T]):
    """A submitted call; ``wait`` gives its outcome (see ``DeadlineCalls.run``)."""

    __slots__ = ("args", "done", "ended", "error", "fn", "late", "lock", "on_end", "on_late", "result", "started",
                 "submitted")

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...], on_late: Callable[[T | None], None] | None,
                 on_end: Callable[[Pending[T]], None] | None = None):
        self.fn, self.args, self.on_late, self.on_end = fn, args, on_late, on_end
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.late = False
        self.result: T | None = None
        self.error: BaseException | None = None
        self.submitted = monotonic()  # a worker is free for it (DeadlineCalls.submit): it starts at once
        self.started = self.ended = self.submitted  #: when a worker began and finished running it

    def run(self) -> None:
        self.started = monotonic()
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # handed to the caller, or to on_late as a None result
            self.error = exc
        self.ended = monotonic()
        if self.on_end is not None:
            try:
                self.on_end(self)
            except Exception:
                log.exception("end callback of %s failed", getattr(self.fn, "__name__", "call"))
        with self.lock:
            self.done.set()
            late = self.late
        if late and self.on_late is not None:
            try:
                self.on_late(None if self.error is not None else self.result)
            except Exception:  # a callback bug must not kill the worker thread; it is logged with its traceback
                log.exception("callback of a late %s failed", getattr(self.fn, "__name__", "call"))

    def wait(self, deadline: float) -> T:
        """The call's result or exception, or CallTimedOut once ``deadline`` passes (the call is then late)."""
        if not self.done.wait(max(0.0, deadline - monotonic())):
            with self.lock:
                if not self.done.is_set():
                    self.late = True
                    raise CallTimedOut(f"{getattr(self.fn, '__name__', 'call')} did not return before its deadline",
                                       ran_s=deadline - self.submitted)
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]


class DeadlineCalls:
    """``workers`` daemon threads that run blocking calls for callers with deadlines. Thread-safe."""

    def __init__(self, workers: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[Pending[Any] | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(workers)
        self._busy = 0  # calls queued or running
        self._changed = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"kvtier-{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def run(self, fn: Callable[..., T], *args: Any, deadline: float,
            on_late: Callable[[T | None], None] | None = None,
            on_end: Callable[[Pending[T]], None] | None = None) -> T:
        """``fn(*args)`` on a worker: its result or its exception, CallNotStarted (see ``submit``), or
        CallTimedOut once ``deadline`` (a ``time.monotonic()`` value) passes. After a CallTimedOut the call
        still ends on its worker, and then ``on_late`` gets its result (None if it raised); it is not called
        when ``run`` returned or raised otherwise. ``on_end`` gets the finished call (its ``submitted``,
        ``started`` and ``ended`` times) on its worker whenever it ends, late or not."""
        return self.submit(fn, *args, deadline=deadline, on_late=on_late, on_end=on_end).wait(deadline)

    def submit(self, fn: Callable[..., T], *args: Any, deadline: float,
               on_late: Callable[[T | None], None] | None = None,
               on_end: Callable[[Pending[T]], None] | None = None) -> Pending[T]:
        """Start ``fn(*args)`` on a worker (waiting for a free one until ``deadline``) and return at once; the
        caller collects it with ``wait``. CallNotStarted if no worker was free in time or the calls are closed."""
        if not self._idle.acquire(timeout=max(0.0, deadline - monotonic())):
            raise CallNotStarted("every worker is busy with calls that have not returned")
        call = Pending(fn, args, on_late, on_end)
        with self._changed:
            if self._closed:
                self._idle.release()
                raise CallNotStarted("closed")
            self._busy += 1
            self._jobs.put(call)
        return call

    def close(self, wait_s: float) -> bool:
        """Refuse new calls, stop the workers once the calls under way have ended, and wait up to ``wait_s`` for
        that; True if none is still running (the engine they use may then be torn down)."""
        with self._changed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
            return self._changed.wait_for(lambda: self._busy == 0, timeout=wait_s)

    def _work(self) -> None:
        while (call := self._jobs.get()) is not None:
            try:
                call.run()
            finally:
                self._idle.release()
                with self._changed:
                    self._busy -= 1
                    self._changed.notify_all()
