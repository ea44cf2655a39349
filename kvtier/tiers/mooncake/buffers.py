"""Memory the transfer engine moves values out of and into: registered once, carved per call.

Mooncake's zero-copy calls (``batch_put_from`` / ``batch_get_into``) need memory registered with the transfer engine
(RDMA pins and maps it; registering costs milliseconds, so it is done once, never per call). The tier keeps one
arena of ``buffer_bytes``, allocated, faulted in and registered on first use, carved by the first-fit allocator the
memory tier uses. A batch that could fit the arena waits for room (other batches release theirs) until its deadline,
gets ahead of puts; a value that then finds no room is a miss or a skipped store. Callers keep their gets within the
arena (the tier's ``max_get_bytes``, kvtier.core.bounded), so concurrent ones queue rather than miss.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.base.errors import TierError
from kvtier.native.allocator import Allocator
from kvtier.tiers.mooncake.turns import LoadsFirst

#: Registers (address, bytes, owner, deadline) with the transfer engine; 0 on success; may raise TierError.
Register = Callable[[int, int, object, float], int]
_ALIGN = 64  # blob payloads start 64-byte aligned within a value


class Slot:
    """Room for one value: ``view`` (exactly ``nbytes``) at address ``ptr``."""

    __slots__ = ("nbytes", "offset", "ptr", "view")

    def __init__(self, view: memoryview, ptr: int, offset: int, nbytes: int) -> None:
        self.view, self.ptr, self.offset, self.nbytes = view, ptr, offset, nbytes


class Lease:
    """The slots of one batch, None where no room was left. ``release`` hands them back, once."""

    def __init__(self, owner: RegisteredBuffers, slots: list[Slot | None]) -> None:
        self.slots = slots
        self._owner = owner
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner._release(self.slots)


class RegisteredBuffers:
    """Thread-safe. ``register`` is called once for the arena (again after a failed attempt)."""

    def __init__(self, arena_bytes: int, register: Register) -> None:
        self._register = register
        self._alloc = Allocator(arena_bytes, align=_ALIGN)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  #: notified whenever a lease is released
        self._order = LoadsFirst(self._freed)
        self._creating = threading.Lock()  # one arena, registered once, however many first takes race
        self._arena: np.ndarray | None = None
        self._view = memoryview(b"")
        self._base = 0
        self.waited = 0  #: takes that found too little free and waited for other leases (for tests)

    @property
    def capacity(self) -> int:
        """The arena's bytes: the most one batch can hold (each size rounded up to 64 bytes)."""
        return self._alloc.capacity

    def rounded(self, nbytes: int) -> int:
        """The room a value of ``nbytes`` takes in the arena (at least 1 byte, rounded up to 64)."""
        return self._alloc.rounded(max(nbytes, 1))

    def take(self, sizes: Sequence[int], deadline: float, load: bool = False) -> Lease:
        """A slot for each size. A batch that fits the arena at all waits, until ``deadline`` (monotonic), for
        the whole batch to fit in what is free; past it, and at once for a batch larger than the arena, each
        size that fits what is free then gets a slot and the others None. A ``load`` (a get) goes first: a save
        waits while any load waits for room (turns.LoadsFirst)."""
        if self._arena is None:
            with self._creating:
                if self._arena is None:
                    self._create(deadline)
        slots: list[Slot | None] = [None] * len(sizes)
        with self._freed:
            if self._arena is None:
                return Lease(self, slots)
            need = sum(self._alloc.rounded(max(n, 1)) for n in sizes)
            if need <= self._alloc.capacity:

                def fits() -> bool:  # places the whole batch when it does
                    return need <= self._alloc.capacity - self._alloc.used and self._place(sizes, slots)

                if self._order.may_take(load) and fits():
                    return Lease(self, slots)
                self.waited += 1
                if self._order.wait(load, fits, deadline):
                    return Lease(self, slots)
            for i, n in enumerate(sizes):
                self._place_one(i, n, slots)
        return Lease(self, slots)

    def _place(self, sizes: Sequence[int], slots: list[Slot | None]) -> bool:
        """Slots for the whole batch, or none of them (False). Holding the lock."""
        for i, n in enumerate(sizes):
            if not self._place_one(i, n, slots):
                for j in range(i):
                    self._alloc.free(slots[j].offset, slots[j].nbytes)  # type: ignore[union-attr]
                    slots[j] = None
                return False
        return True

    def _place_one(self, i: int, n: int, slots: list[Slot | None]) -> bool:
        offset = self._alloc.alloc(n)
        if offset is None:
            return False
        slots[i] = Slot(self._view[offset : offset + n], self._base + offset, offset, n)
        return True

    def _create(self, deadline: float) -> None:
        arena = np.zeros(self._alloc.capacity, dtype=np.uint8)  # zeros: faulted in now, not mid-transfer
        try:
            registered = self._register(arena.ctypes.data, arena.nbytes, arena, deadline) == 0
        except TierError:
            registered = False
        if registered:
            with self._lock:
                self._arena, self._view, self._base = arena, memoryview(arena), arena.ctypes.data

    def _release(self, slots: list[Slot | None]) -> None:
        with self._freed:
            for slot in slots:
                if slot is not None:
                    self._alloc.free(slot.offset, slot.nbytes)
            self._freed.notify_all()

    @property
    def largest_free(self) -> int:
        """The largest value a take could place now (the whole arena when nothing is leased)."""
        with self._lock:
            return self._alloc.largest_free() if self._arena is not None else 0

    @property
    def registered_bytes(self) -> int:
        return 0 if self._arena is None else self._arena.nbytes
