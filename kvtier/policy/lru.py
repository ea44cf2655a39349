"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.base.keys import ChunkHash
from kvtier.policy.base import renew_in_order


class LRUPolicy:
    """Evicts the least recently inserted or accessed key that is evictable (pinned keys are skipped)."""

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkHash, None] = OrderedDict()

    def on_insert(self, key: ChunkHash) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: ChunkHash) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: ChunkHash) -> None:
        self._order.pop(key, None)

    def on_chain(self, keys: Sequence[ChunkHash]) -> None:
        renew_in_order([self._order], keys)

    def victim(self, evictable: Callable[[ChunkHash], bool]) -> ChunkHash | None:
        for key in self._order:
            if evictable(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)
