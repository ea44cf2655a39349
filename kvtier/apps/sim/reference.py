"""Two references on the same requests, keyed by the same chunk hashes as the replayed caches.

* ``ideal_hits``: a cache that never evicts. A request hits the longest prefix of its chunks seen before.
* ``belady_hits``: the offline optimum of one cache of ``capacity`` chunks (Belady's MIN, with bypass): when
  room is needed it evicts the chunk whose next use is farthest away, and it never admits a chunk used later
  than everything it holds (or never again). A chunk is used by every later request whose prompt contains
  it, and a descendant is never used without its ancestors, so the farthest next use always falls on the
  deepest chunks of a chain first; ties go to the deeper chunk.

Both count hits as kvtier does: a request's chunks hit up to the first one missing. These are references,
not kvtier code paths: they use plain Python sets and a heap.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvtier.base.keys import ChunkHash

_NEVER = 1 << 62


def ideal_hits(chains: Sequence[Sequence[ChunkHash]]) -> int:
    """Hit chunks of an infinite cache."""
    seen: set[ChunkHash] = set()
    hits = 0
    for keys in chains:
        hits += _prefix(keys, seen)
        seen.update(keys)
    return hits


def next_uses(chains: Sequence[Sequence[ChunkHash]]) -> list[list[int]]:
    """For every chunk of every request, the index of the next request using it (``_NEVER`` if none)."""
    upcoming: dict[ChunkHash, int] = {}
    out: list[list[int]] = [[] for _ in chains]
    for i in range(len(chains) - 1, -1, -1):
        out[i] = [upcoming.get(key, _NEVER) for key in chains[i]]
        for key in chains[i]:
            upcoming[key] = i
    return out


def belady_hits(chains: Sequence[Sequence[ChunkHash]], capacity: int,
                upcoming: list[list[int]] | None = None) -> int:
    """Hit chunks of the offline optimum with ``capacity`` chunks."""
    upcoming = upcoming if upcoming is not None else next_uses(chains)
    held: dict[ChunkHash, int] = {}  # key -> its next use
    heap: list[tuple[int, int, ChunkHash]] = []  # (-next use, -depth, key); stale entries skipped lazily
    hits = 0
    for keys, nexts in zip(chains, upcoming):
        hits += _prefix(keys, held)
        for depth, (key, nxt) in enumerate(zip(keys, nexts)):
            if key not in held:
                if nxt == _NEVER or capacity <= 0:
                    continue
                if len(held) >= capacity:
                    far, far_depth, far_key = _farthest(heap, held)
                    if (nxt, depth) >= (far, far_depth):
                        continue  # everything held is needed sooner: do not admit
                    heapq.heappop(heap)
                    del held[far_key]
            held[key] = nxt
            heapq.heappush(heap, (-nxt, -depth, key))
    return hits


def _farthest(heap: list[tuple[int, int, ChunkHash]], held: dict[ChunkHash, int]) -> tuple[int, int, ChunkHash]:
    while True:
        neg_next, neg_depth, key = heap[0]
        if held.get(key) == -neg_next:
            return -neg_next, -neg_depth, key
        heapq.heappop(heap)


def _prefix(keys: Sequence[ChunkHash], present: set[ChunkHash] | dict[ChunkHash, int]) -> int:
    for i, key in enumerate(keys):
        if key not in present:
            return i
    return len(keys)
