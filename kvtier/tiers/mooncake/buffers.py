"""Memory the transfer engine moves values out of and into: registered once, carved per call.

Mooncake's zero-copy calls (``batch_put_from`` / ``batch_get_into``) need memory registered with the transfer
engine (RDMA pins and maps it; registering costs milliseconds, so it is done once, never per call). The tier
keeps regions of registered memory, each carved by the first-fit allocator the memory tier uses. It starts
with one region and adds another when a batch does not fit in what is free, up to ``max_bytes`` in all;
regions stay registered until the tier closes. A value that finds no room is a miss or a skipped store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.errors import TierError
from kvtier.tiers.allocator import Allocator

#: Registers (address, bytes, owner, deadline) with the transfer engine; 0 on success; may raise TierError.
Register = Callable[[int, int, object, float], int]
#: A new region is at least this large, so growing happens a few times, not per batch.
MIN_REGION_BYTES = 64 << 20
_ALIGN = 64  # blob payloads start 64-byte aligned within a value


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Region:
    __slots__ = ("alloc", "base", "buf", "view")

    def __init__(self, nbytes: int) -> None:
        self.alloc = Allocator(nbytes, align=_ALIGN)
        self.buf = np.zeros(self.alloc.capacity, dtype=np.uint8)  # zeros: faulted in now, not mid-request
        self.base = self.buf.ctypes.data
        self.view = memoryview(self.buf)


class Slot:
    """Room for one value: ``view`` (exactly ``nbytes``) at address ``ptr``."""

    __slots__ = ("nbytes", "offset", "ptr", "region", "view")

    def __init__(self, region: _Region, offset: int, nbytes: int) -> None:
        self.region, self.offset, self.nbytes = region, offset, nbytes
        self.view = region.view[offset : offset + nbytes]
        self.ptr = region.base + offset


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
    """Thread-safe. ``register`` is called for each new region (see ``Register``)."""

    def __init__(self, max_bytes: int, register: Register) -> None:
        self.max_bytes = max_bytes
        self._register = register
        self._lock = threading.Lock()
        self._regions: list[_Region] = []
        self._reserved = 0  # bytes of regions registered or being registered

    def take(self, sizes: Sequence[int], deadline: float) -> Lease:
        """A slot for each size (None where nothing is left), adding one region if needed and allowed."""
        slots: list[Slot | None] = [None] * len(sizes)
        with self._lock:
            rest = self._place(sizes, range(len(sizes)), slots)
            grow = 0
            if rest:
                need = sum(_aligned(sizes[i]) for i in rest)
                grow = min(max(need, MIN_REGION_BYTES), (self.max_bytes - self._reserved) // _ALIGN * _ALIGN)
                grow = grow if grow >= _aligned(min(sizes[i] for i in rest)) else 0
                self._reserved += grow
        if grow:
            region = self._grow(grow, deadline)
            if region is not None:
                with self._lock:
                    self._regions.append(region)
                    self._place(sizes, rest, slots)
        return Lease(self, slots)

    def _place(self, sizes: Sequence[int], todo: Sequence[int], slots: list[Slot | None]) -> list[int]:
        """First fit over the regions; the indices left without room. Caller holds the lock."""
        rest = []
        for i in todo:
            for region in self._regions:
                offset = region.alloc.alloc(sizes[i])
                if offset is not None:
                    slots[i] = Slot(region, offset, sizes[i])
                    break
            else:
                rest.append(i)
        return rest

    def _grow(self, nbytes: int, deadline: float) -> _Region | None:
        region = _Region(nbytes)
        try:
            ok = self._register(region.base, region.buf.nbytes, region, deadline) == 0
        except TierError:
            ok = False
        if not ok:
            with self._lock:
                self._reserved -= nbytes
            return None
        return region

    def _release(self, slots: list[Slot | None]) -> None:
        with self._lock:
            for slot in slots:
                if slot is not None:
                    slot.region.alloc.free(slot.offset, slot.nbytes)

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(region.buf.nbytes for region in self._regions)
