"""Reusable transfer buffers for tiers that move values over the network.

A fresh large allocation is slow (the kernel maps and zero-fills every page on first touch), so values are
received into and staged from buffers that are handed back and reused. ``max_idle_bytes`` caps what the pool
keeps between calls; buffers beyond it are dropped.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np

_SMALL = 64 * 1024


def _rounded(n: int) -> int:
    if n <= _SMALL:
        return max(4096, 1 << (max(n, 1) - 1).bit_length())
    return (n + _SMALL - 1) // _SMALL * _SMALL


class TransferBufferPool:
    """Buffers that network values are received into and staged in before sending.

    Thread-safe. ``acquire(n)`` gives an uninitialised uint8 array of at least ``n`` bytes; ``release`` hands it
    back (it must not be used afterwards).
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._sizes: list[int] = []  # sorted sizes of idle buffers
        self._bufs: list[np.ndarray] = []  # idle buffers, in the order of _sizes
        self.idle_bytes = 0

    def acquire(self, n: int) -> np.ndarray:
        want = _rounded(n)
        with self._lock:
            i = bisect.bisect_left(self._sizes, want)
            # reuse the smallest idle buffer that fits without wasting more than half of it
            if i < len(self._sizes) and self._sizes[i] <= 2 * want:
                size = self._sizes.pop(i)
                self.idle_bytes -= size
                return self._bufs.pop(i)
        return np.empty(want, dtype=np.uint8)

    def release(self, buf: np.ndarray) -> None:
        size = buf.nbytes
        with self._lock:
            if self.idle_bytes + size > self.max_idle_bytes:
                if not self._sizes or self._sizes[0] >= size:
                    return  # keep what is there rather than churn
                # drop small idle buffers to make room for this larger one
                while self._sizes and self.idle_bytes + size > self.max_idle_bytes and self._sizes[0] < size:
                    self.idle_bytes -= self._sizes.pop(0)
                    self._bufs.pop(0)
                if self.idle_bytes + size > self.max_idle_bytes:
                    return
            i = bisect.bisect_left(self._sizes, size)
            self._sizes.insert(i, size)
            self._bufs.insert(i, buf)
            self.idle_bytes += size

    def clear(self) -> None:
        with self._lock:
            self._sizes.clear()
            self._bufs.clear()
            self.idle_bytes = 0
