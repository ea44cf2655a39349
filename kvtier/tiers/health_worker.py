"""One background health thread for a remote tier (Redis, Mooncake): probes an open circuit breaker, joins a pool,
refreshes a slot map, while there is something to do, and not otherwise.

``HealthWorker.start()`` wakes the thread, or starts one if none runs (none once the tier is closed). The tier's
``turns`` does the work: it waits with ``wake.wait(seconds)`` (cut short by ``start``), clears ``wake`` at the
start of each turn, and returns once ``idle()`` says nothing was asked meanwhile. ``idle`` decides under the
tier's lock, the one ``start`` takes, so a ``start`` racing with the thread's end is never lost: either the thread
sees the wake, or ``start`` sees no thread and starts one. What ``turns`` raises (a bug: probes report failures
as False) is logged, and it runs again a second later, so a tier's recovery never stops for good.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class HealthWorker:
    """At most one daemon thread named ``name`` running ``turns`` (see the module docstring); ``closed()`` says
    the tier is closed (no thread starts, a running one ends at its next turn); ``what`` names the tier in logs."""

    def __init__(self, name: str, turns: Callable[[], None], lock: threading.Lock, closed: Callable[[], bool],
                 what: str) -> None:
        self.wake = threading.Event()
        self._name, self._turns, self._lock, self._closed, self._what = name, turns, lock, closed, what
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            self.wake.set()
            if self._closed() or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def idle(self) -> bool:
        """True (and the thread is to end now) if nothing woke it since its turn began; call from ``turns``."""
        with self._lock:
            if self.wake.is_set():
                return False
            self._thread = None
            return True

    def _run(self) -> None:
        while not self._closed():
            try:
                self._turns()
                return
            except Exception:
                log.exception("%s: the health thread failed; it goes on in a second", self._what)
                self.wake.wait(1.0)
