"""The router's bounded queue: ``max_in_flight`` requests proxied at once, ``max_queue`` more waiting, and an
immediate ``Overloaded`` (a 429 with Retry-After) beyond that. Waiters are served first come, first served."""

from __future__ import annotations

import asyncio

from kvtier.apps.route.config import AdmissionConfig


class Overloaded(Exception):
    """Every slot is taken and the queue is full."""


class Slot:
    """One admitted request; ``release()`` is idempotent (every exit path may call it)."""

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self._semaphore: asyncio.Semaphore | None = semaphore

    def release(self) -> None:
        if self._semaphore is not None:
            self._semaphore.release()
            self._semaphore = None


class Admission:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._semaphore = asyncio.Semaphore(config.max_in_flight)
        self.waiting = 0

    async def admit(self) -> Slot:
        """A slot, once one is free; Overloaded at once if ``max_queue`` requests are already waiting."""
        if self._semaphore.locked() and self.waiting >= self.config.max_queue:
            raise Overloaded(f"{self.config.max_in_flight} requests in flight and {self.waiting} waiting")
        self.waiting += 1
        try:
            await self._semaphore.acquire()
        finally:
            self.waiting -= 1
        return Slot(self._semaphore)
