"""Cutting a get or a put into batches that each fit the transfer buffer, and the host memory a get larger than
the buffer lands in.

A get or put whose values do not fit the registered buffer at once (buffers.py) is moved in slices, one batch
call each. A put's slices are staged one ahead: the next slice is copied into the buffer while the last one
moves, so slices are cut to half the buffer. A get's views must all stay valid until its ``with`` block ends,
so each slice but the last is copied out of the buffer into spill memory before the next is read; the last
stays where it arrived. A slice that fails is a miss (or a skipped store) for its own values only.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from kvtier.native.hugepages import huge_page_map


def cut(sizes: Sequence[int], limit: int, rounded=lambda n: n) -> list[list[int]]:
    """Indices of ``sizes`` cut in order into slices whose ``rounded`` sizes add up to at most ``limit``; a size
    larger than ``limit`` alone in its slice (a get or put of it then finds no room: a miss, a skipped store)."""
    slices: list[list[int]] = []
    held = 0
    for i, n in enumerate(sizes):
        n = rounded(max(n, 1))
        if slices and held + n <= limit:
            slices[-1].append(i)
            held += n
        else:
            slices.append([i])
            held = n
    return slices


class Spill:
    """Host memory for the slices of gets larger than the transfer buffer. Thread-safe.

    Fresh memory costs a page fault per page (about 1 GB/s here; huge pages, 5-6 GB/s), so the largest block
    handed back, up to ``keep_bytes``, is kept for the next such get."""

    def __init__(self, keep_bytes: int) -> None:
        self._keep = keep_bytes
        self._spare: np.ndarray | None = None
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` (the spare when it is large enough, else a new one)."""
        with self._lock:
            if self._spare is not None and self._spare.nbytes >= nbytes:
                block, self._spare = self._spare, None
                return block
        return np.frombuffer(huge_page_map(nbytes), dtype=np.uint8)

    def give_back(self, block: np.ndarray) -> None:
        """``block`` is no longer read: kept as the spare if it is the largest that may be kept."""
        with self._lock:
            if block.nbytes <= self._keep and (self._spare is None or self._spare.nbytes < block.nbytes):
                self._spare = block

    @property
    def spare_bytes(self) -> int:
        return 0 if self._spare is None else self._spare.nbytes
