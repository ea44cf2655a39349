"""Transfer turns where a load goes first.

A replica moves at most ``max_transfers`` batches at once (over TCP, more only queue in the engine). Loads are on
a request's path to its first token; saves are write-behind and can wait or be skipped. So a save takes a free
turn only while no load is waiting for one: under a steady stream of saves, a load waits for the batches already
moving, not for the saves queued before it. A save that finds no turn before its deadline is skipped, as before.
"""

from __future__ import annotations

import threading
from time import monotonic


class LoadsFirst:
    """Counts the loads waiting for a resource; a save may take it only while the count is 0. The caller holds
    ``cond`` (the condition its waiters sleep on, notified on every release) around both methods' use."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.waiting = 0  #: loads waiting now

    def may_take(self, load: bool) -> bool:
        return load or self.waiting == 0

    def wait(self, load: bool, ready, deadline: float) -> bool:
        """Wait (``cond`` held) until ``ready()`` and this side may take; False once ``deadline`` passes."""
        if load:
            self.waiting += 1
        try:
            while not (self.may_take(load) and ready()):
                left = deadline - monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True
        finally:
            if load:
                self.waiting -= 1
                self._cond.notify_all()  # saves held back by this load may look again


class Turns:
    """``n`` transfer turns, thread-safe; loads ahead of saves (see the module)."""

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self._free = n
        self._order = LoadsFirst(self._cond)

    @property
    def loads_waiting(self) -> int:
        return self._order.waiting

    def acquire(self, load: bool, timeout: float) -> bool:
        """A turn, or False if none came (to this side) within ``timeout`` seconds."""
        with self._cond:
            if not self._order.wait(load, lambda: self._free > 0, monotonic() + timeout):
                return False
            self._free -= 1
            return True

    def release(self) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify_all()
