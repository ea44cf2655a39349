"""W-TinyLFU (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", 2017; the
policy of Caffeine).

New keys enter a small LRU window (1% of the entries). The window's oldest key is the candidate for the main
region, a segmented LRU (probation, and protected for keys used again there, 80% of main). When room is
needed and the window is full, the candidate competes with probation's least recent key: whichever a
count-min sketch (kvtier.policy.sketch, aged by halving) says was used less often is evicted (on a tie, the
older one), so a key used many times in the recent past is kept over a new one, even after it was evicted
and came back.

``victim`` changes nothing: it names the loser of that contest. When the winner was the candidate, the main
key's ``on_remove`` moves the candidate from the window into probation (the room the contest freed).
Window and protected sizes are shares of the most entries the tier has held (the policy is never told the
tier's capacity; chunks of one model have one size, so that is the capacity once the tier has filled).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import chain

from kvtier.base.keys import ChunkHash
from kvtier.policy.base import first_evictable, renew_in_order
from kvtier.policy.sketch import FrequencySketch

WINDOW_SHARE = 0.01
PROTECTED_SHARE = 0.8  #: of the main region


class TinyLFUPolicy:
    def __init__(self) -> None:
        # LRU order in each region: least recent first
        self._window: OrderedDict[ChunkHash, bool] = OrderedDict()  # key -> used again while in the window
        self._probation: OrderedDict[ChunkHash, None] = OrderedDict()
        self._protected: OrderedDict[ChunkHash, None] = OrderedDict()
        self._sketch = FrequencySketch()
        self._high_water = 0

    def on_insert(self, key: ChunkHash) -> None:
        if key in self._window or key in self._probation or key in self._protected:
            self.on_access(key)
            return
        self._high_water = max(self._high_water, len(self) + 1)
        self._sketch.ensure_capacity(self._high_water)
        self._sketch.increment(key)
        self._window[key] = False
        while len(self._window) > self._window_size():  # no eviction was needed: admitted without a contest
            self._admit()

    def on_access(self, key: ChunkHash) -> None:
        if key in self._window:
            self._window[key] = True
            self._window.move_to_end(key)
        elif key in self._probation:
            del self._probation[key]
            self._protect(key)
        elif key in self._protected:
            self._protected.move_to_end(key)
        else:
            return
        self._sketch.increment(key)

    def on_remove(self, key: ChunkHash) -> None:
        if key in self._window:
            del self._window[key]
            return
        if key in self._probation:
            del self._probation[key]
        elif key in self._protected:
            del self._protected[key]
        else:
            return
        if self._window and len(self._window) >= self._window_size():
            self._admit()  # the candidate won the room this removal freed

    def on_chain(self, keys: Sequence[ChunkHash]) -> None:
        # The window is its own region: if deeper chunks of the chain sit in it while shallower ones sit in
        # the main region, they trade places, so the window holds the chain's shallowest chunks, as when a
        # request's chunks arrive deepest first.
        window = self._window
        in_window = [k for k in keys if k in window]
        if in_window:
            held = [k for k in keys if k in window or k in self._probation or k in self._protected]
            shallow = set(held[: len(in_window)])
            self._trade_places([k for k in in_window if k not in shallow],
                               [k for k in held[: len(in_window)] if k not in window])
        renew_in_order([window, self._probation, self._protected], keys)

    def _trade_places(self, deeper_in_window: list[ChunkHash], shallower_in_main: list[ChunkHash]) -> None:
        """Swap each window key with a main-region key, pair by pair (both lists in chain order). The deeper key
        goes on probation, never into protected (it must not outlast its ancestor there); the shallower one
        keeps its claim to protected through the window's used flag."""
        for out, into in zip(deeper_in_window, shallower_in_main):
            del self._window[out]
            was_protected = into in self._protected
            del (self._protected if was_protected else self._probation)[into]
            self._probation[out] = None
            self._window[into] = was_protected

    def victim(self, evictable: Callable[[ChunkHash], bool]) -> ChunkHash | None:
        main = first_evictable(chain(self._probation, self._protected), evictable)
        candidate = first_evictable(self._window, evictable)
        if main is None or candidate is None:
            return candidate if main is None else main
        if len(self._window) < self._window_size():  # window not full: nothing to admit, evict from main
            return main
        sketch = self._sketch
        # ties go to the candidate, the more recent key: in a prefix cache it is often the ancestor of the
        # main region's victim (a request's chunks arrive deepest first), and evicting it first would leave
        # its descendants unreachable
        return candidate if sketch.estimate(candidate) < sketch.estimate(main) else main

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def _admit(self) -> None:
        """Move the window's oldest key into the main region: protected if it was used again in the window
        (as if it had been on probation), else on probation."""
        key, used = self._window.popitem(last=False)
        if used:
            self._protect(key)
        else:
            self._probation[key] = None

    def _protect(self, key: ChunkHash) -> None:
        self._protected[key] = None
        limit = PROTECTED_SHARE * (self._high_water - self._window_size())
        while len(self._protected) > limit:
            self._probation[self._protected.popitem(last=False)[0]] = None

    def _window_size(self) -> int:
        return max(1, int(WINDOW_SHARE * self._high_water))
