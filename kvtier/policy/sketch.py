"""A count-min sketch of how often keys were used, with aging: frequency that outlives eviction.

Four rows of saturating counters (0..15, as in TinyLFU), one counter per row chosen by 32 independent bits of
the key. Chunk keys are SHA-256 digests, so their bytes already are uniform hash bits; shorter keys are hashed
first. Increments are conservative (only the counters at the current minimum grow), which keeps estimates
of rare keys low when popular ones share their counters.

Aging: after ``SAMPLE_FACTOR x entries`` increments (ten times the tier's size, TinyLFU's choice) every
counter is halved, so the sketch describes the recent past and a key popular long ago fades.

Sizing: a period sees several times ``entries`` distinct keys, and a key never seen must read 0 (policies
ask "was this key used before?", and a false yes can keep a chunk whose ancestor is gone), so each row has
``COUNTERS_PER_ENTRY`` counters per entry: on the Mooncake trace about one never-seen key in 20,000 read
as seen (with 16 per entry, one in 350 did, and that cost hit ratio). Memory is ``4 x width`` bytes, 256 bytes
per entry, tiny beside a chunk of KV. ``width`` starts small and doubles (up to ``MAX_WIDTH``) as the
owner reports more entries; doubling copies each row twice, so estimates carry over unchanged.
"""

from __future__ import annotations

import hashlib
import struct

ROWS = 4
MAX_COUNT = 15
COUNTERS_PER_ENTRY = 64
SAMPLE_FACTOR = 10
MIN_WIDTH = 64
MAX_WIDTH = 1 << 24  # 64 MiB of counters at most: 262,144 entries at full precision, fewer beyond
_HALVE = bytes(i >> 1 for i in range(256))


_WORDS = struct.Struct("<4I")


def _words(key: bytes) -> tuple[int, int, int, int]:
    """Four uniform 32-bit words of ``key``: one counter index per row."""
    if len(key) < 16:
        key = hashlib.blake2b(key, digest_size=16).digest()
    return _WORDS.unpack_from(key)


class FrequencySketch:
    """Approximate recent use counts of keys. Not thread-safe: the owning policy runs under its tier's lock."""

    __slots__ = ("_rows", "_mask", "_period", "_added")

    def __init__(self, entries: int = 1) -> None:
        self._rows = [bytearray(MIN_WIDTH) for _ in range(ROWS)]
        self._mask = MIN_WIDTH - 1
        self._period = SAMPLE_FACTOR
        self._added = 0
        self.ensure_capacity(entries)

    @property
    def width(self) -> int:
        return self._mask + 1

    @property
    def nbytes(self) -> int:
        return ROWS * self.width

    def ensure_capacity(self, entries: int) -> None:
        """Size for a tier of ``entries`` entries (grows, never shrinks), keeping every estimate."""
        self._period = max(self._period, SAMPLE_FACTOR * entries)
        while self.width < min(COUNTERS_PER_ENTRY * entries, MAX_WIDTH):
            self._rows = [row + row for row in self._rows]  # index = bits & mask: both halves mirror the old row
            self._mask = len(self._rows[0]) - 1

    def estimate(self, key: bytes) -> int:
        a, b, c, d = _words(key)
        mask, (r0, r1, r2, r3) = self._mask, self._rows
        return min(r0[a & mask], r1[b & mask], r2[c & mask], r3[d & mask])

    def increment(self, key: bytes) -> None:
        a, b, c, d = _words(key)
        mask, (r0, r1, r2, r3) = self._mask, self._rows
        a, b, c, d = a & mask, b & mask, c & mask, d & mask
        low = min(r0[a], r1[b], r2[c], r3[d])
        if low < MAX_COUNT:  # conservative update: only the counters at the minimum grow
            if r0[a] == low:
                r0[a] = low + 1
            if r1[b] == low:
                r1[b] = low + 1
            if r2[c] == low:
                r2[c] = low + 1
            if r3[d] == low:
                r3[d] = low + 1
        self._added += 1
        if self._added >= self._period:
            self._age()

    def _age(self) -> None:
        for i, row in enumerate(self._rows):
            self._rows[i] = row.translate(_HALVE)
        self._added //= 2
