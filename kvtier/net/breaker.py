"""A circuit breaker for a remote store: stop calling it after repeated failures, probe it in the background.

States: CLOSED (calls go through), OPEN (calls are refused at once). ``failure_threshold`` consecutive
failures open it; while open, the owner's prober (not a request) checks the store every ``cooldown_s`` and
closes the breaker on the first success. So once a store is known dead, no request waits on it at all, and
requests flow again within one cool-down of its recovery.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from time import monotonic


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1


class CircuitBreaker:
    """Thread-safe. ``on_change(new_state)`` is called outside the lock after each transition."""

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 2.0,
        *,
        on_change: Callable[[BreakerState], None] | None = None,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        if failure_threshold < 1 or cooldown_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and cooldown_s > 0")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._last_probe = 0.0
        self.opens = 0  #: times it opened

    @property
    def state(self) -> BreakerState:
        return self._state

    def allow(self) -> bool:
        """Whether a request may call the store now."""
        return self._state is BreakerState.CLOSED

    def success(self) -> None:
        if self._state is BreakerState.CLOSED and self._failures == 0:
            return  # the common case, without the lock
        with self._lock:
            changed = self._state is not BreakerState.CLOSED
            self._state, self._failures = BreakerState.CLOSED, 0
        if changed and self._on_change:
            self._on_change(BreakerState.CLOSED)

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            opened = self._state is BreakerState.CLOSED and self._failures >= self.failure_threshold
            if opened:
                self._state = BreakerState.OPEN
                self._opened_at = self._last_probe = self._clock()
                self.opens += 1
        if opened and self._on_change:
            self._on_change(BreakerState.OPEN)

    def probe_due(self) -> bool:
        """For the prober: True (and the probe slot taken) when open and a cool-down passed since the last
        probe."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                return False
            now = self._clock()
            if now - self._last_probe < self.cooldown_s:
                return False
            self._last_probe = now
            return True

    def seconds_to_next_probe(self) -> float:
        with self._lock:
            if self._state is not BreakerState.OPEN:
                return self.cooldown_s
            return max(0.0, self._last_probe + self.cooldown_s - self._clock())
