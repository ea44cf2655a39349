"""ARC (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003), and a variant
whose memory of past use is a frequency sketch as well as ARC's ghost lists.

ARC keeps two LRU lists: T1 for keys used once since they entered, T2 for keys used again. Ghost lists B1 and
B2 remember keys recently evicted from each. A key stored again while in B1 means T1 was too small, so T1's
target share ``p`` grows; one in B2 shrinks it. Eviction takes T1's least recent key while T1 is above its
target, else T2's. No constant is tuned: the split adapts to the workload.

ARC needs its capacity ``c`` in entries, which a policy behind a byte-capacity tier is never told: it uses
the most entries the tier has held (chunks of one model have one size, so that is the capacity once the tier
has filled). Ghost lists are bounded as in ARC: ``|T1| + |B1| <= c`` and all four lists ``<= 2c``.

``ARCPolicy(history=True)`` (``arc-lfu``) adds a count-min sketch with aging (kvtier.policy.sketch) that
remembers about ten times the tier's size in past uses. A key stored again after its ghost was forgotten,
but that the sketch saw, is known to be reused: it enters T2 instead of T1. In a prefix cache the chunks
worth keeping are those of prefixes that come back (system prompts, documents, conversations continued
after a pause), and they often come back after longer gaps than ARC's ghosts cover.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.base.keys import ChunkHash
from kvtier.policy.base import first_evictable, renew_in_order
from kvtier.policy.sketch import FrequencySketch


class ARCPolicy:
    def __init__(self, *, history: bool = False) -> None:
        # every list is in LRU order: least recent first
        self._t1: OrderedDict[ChunkHash, None] = OrderedDict()
        self._t2: OrderedDict[ChunkHash, None] = OrderedDict()
        self._b1: OrderedDict[ChunkHash, None] = OrderedDict()
        self._b2: OrderedDict[ChunkHash, None] = OrderedDict()
        self._p = 0.0  # T1's target size
        self._c = 0  # ARC's capacity: the most entries held
        self._sketch = FrequencySketch() if history else None

    def on_insert(self, key: ChunkHash) -> None:
        if key in self._t1 or key in self._t2:
            self.on_access(key)
            return
        self._c = c = max(self._c, len(self) + 1)
        b1, b2 = self._b1, self._b2
        if key in b1:  # evicted from T1 too early: give T1 more room
            self._p = min(c, self._p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            self._t2[key] = None
        elif key in b2:  # evicted from T2 too early: give T2 more room
            self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            self._t2[key] = None
        elif self._sketch is not None and self._sketch.estimate(key) > 0:
            self._t2[key] = None  # used before, beyond the ghosts' memory
        else:
            self._t1[key] = None
        if self._sketch is not None:
            self._sketch.ensure_capacity(c)
            self._sketch.increment(key)
        self._trim_ghosts()

    def on_access(self, key: ChunkHash) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)
        else:
            return
        if self._sketch is not None:
            self._sketch.increment(key)

    def on_remove(self, key: ChunkHash) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def on_chain(self, keys: Sequence[ChunkHash]) -> None:
        renew_in_order([self._t1, self._t2], keys)

    def victim(self, evictable: Callable[[ChunkHash], bool]) -> ChunkHash | None:
        t1_first = bool(self._t1) and (len(self._t1) > self._p or not self._t2)
        for queue in (self._t1, self._t2) if t1_first else (self._t2, self._t1):
            key = first_evictable(queue, evictable)
            if key is not None:
                return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def _trim_ghosts(self) -> None:
        c = self._c
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self) + len(self._b1) + len(self._b2) > 2 * c:
            (self._b2 if self._b2 else self._b1).popitem(last=False)
