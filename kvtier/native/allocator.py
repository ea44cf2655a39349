"""First-fit allocator over one contiguous byte range, with coalescing of neighbouring free blocks.

Plain Python over offsets: it never touches the bytes. Sizes are rounded up to ``align`` so every slot starts
aligned (good for memcpy and for dtype views). Not thread-safe: the owning tier holds its lock around it.
"""

from __future__ import annotations

import bisect


class Allocator:
    def __init__(self, capacity: int, align: int = 256) -> None:
        if capacity < 0 or align <= 0 or align & (align - 1):
            raise ValueError("capacity must not be negative and align must be a power of two")
        self.capacity = capacity // align * align
        self.align = align
        self._starts: list[int] = [0] if self.capacity else []  # free blocks, sorted by offset
        self._sizes: list[int] = [self.capacity] if self.capacity else []
        self.used = 0

    def rounded(self, nbytes: int) -> int:
        return (nbytes + self.align - 1) // self.align * self.align

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot of ``rounded(nbytes)`` bytes, or None if no free block is large enough."""
        need = self.rounded(max(nbytes, 1))
        for i, size in enumerate(self._sizes):
            if size >= need:
                start = self._starts[i]
                if size == need:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] = start + need
                    self._sizes[i] = size - need
                self.used += need
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a slot obtained from ``alloc(nbytes)``."""
        size = self.rounded(max(nbytes, 1))
        i = bisect.bisect_left(self._starts, offset)
        overlaps_next = i < len(self._starts) and self._starts[i] < offset + size
        overlaps_previous = i and self._starts[i - 1] + self._sizes[i - 1] > offset
        if overlaps_next or overlaps_previous:
            raise ValueError(f"double free or overlap at offset {offset}")
        self.used -= size
        # merge with the following block
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._sizes[i]
            del self._starts[i], self._sizes[i]
        # merge with the preceding block
        if i and self._starts[i - 1] + self._sizes[i - 1] == offset:
            self._sizes[i - 1] += size
            return
        self._starts.insert(i, offset)
        self._sizes.insert(i, size)

    def largest_free(self) -> int:
        return max(self._sizes, default=0)
