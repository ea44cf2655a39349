"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023).

Three FIFO queues: new keys enter a small queue S (about 10% of the entries); a key used again while in S
moves to the main queue M when it reaches S's end, one that was not is evicted and remembered in a ghost
queue G (keys only, as many as the tier holds). A key found in G when it is stored again goes straight to M.
M is a CLOCK with two-bit use counts: its oldest key, if used since it last passed, goes round again with one
use less; otherwise it is evicted. Most new chunks of a prefix cache are never read again (the unique tail of
a prompt); S lets them go quickly and keeps M for chunks that proved reusable.

``victim`` must change nothing, so the queues are kept normalised after every hook instead of during
eviction: S's and M's oldest keys are always unused ones, and the moves S3-FIFO would make at eviction time
(S -> M, M round again) are made as soon as a use makes them due. Each use causes at most a few such moves,
so every hook is O(1) amortised and ``victim`` is O(1) unless it has to skip pinned keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.base.keys import ChunkHash
from kvtier.policy.base import first_evictable, renew_in_order

SMALL_SHARE = 0.1  #: S's share of the entries (the paper's choice across its traces)
MAX_USES = 3  #: two-bit use counters


class S3FIFOPolicy:
    def __init__(self) -> None:
        self._small: OrderedDict[ChunkHash, int] = OrderedDict()  # key -> uses since it entered; oldest first
        self._main: OrderedDict[ChunkHash, int] = OrderedDict()
        self._ghost: OrderedDict[ChunkHash, None] = OrderedDict()
        self._high_water = 0  # most entries held: the ghost queue's bound

    def on_insert(self, key: ChunkHash) -> None:
        if key in self._small or key in self._main:
            self.on_access(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0
        self._high_water = max(self._high_water, len(self))

    def on_access(self, key: ChunkHash) -> None:
        for queue in (self._small, self._main):
            uses = queue.get(key)
            if uses is not None:
                queue[key] = min(uses + 1, MAX_USES)
                self._normalise()
                return

    def on_remove(self, key: ChunkHash) -> None:
        if self._small.pop(key, None) is not None:
            self._ghost[key] = None
            while len(self._ghost) > self._high_water:
                self._ghost.popitem(last=False)
        elif self._main.pop(key, None) is None:
            return
        self._normalise()

    def on_chain(self, keys: Sequence[ChunkHash]) -> None:
        # S's order is the order keys arrived in; M's is the order they qualified in, which a use never changes
        renew_in_order([self._small], keys)  # use counts stay
        self._normalise()

    def victim(self, evictable: Callable[[ChunkHash], bool]) -> ChunkHash | None:
        small_first = bool(self._small) and (len(self._small) >= SMALL_SHARE * len(self) or not self._main)
        queues = (self._small, self._main) if small_first else (self._main, self._small)
        for queue in queues:  # unused keys first, in FIFO order
            key = first_evictable((k for k, uses in queue.items() if uses == 0), evictable)
            if key is not None:
                return key
        for queue in queues:  # only pinned or recently used keys left: the oldest evictable one
            key = first_evictable(queue, evictable)
            if key is not None:
                return key
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def _normalise(self) -> None:
        """Make the moves eviction would make at the queues' ends, so their oldest keys are unused ones."""
        small, main = self._small, self._main
        while small and small[key := next(iter(small))]:
            del small[key]
            main[key] = 0  # used while in S: on to M, its count cleared
        while main and (uses := main[key := next(iter(main))]):
            del main[key]
            main[key] = uses - 1  # CLOCK: round again with one use less
