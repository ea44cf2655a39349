"""The eviction policy protocol: bookkeeping hooks plus one decision hook.

The tier owns the bytes and the accounting; the policy only orders keys. ``victim`` proposes a key the tier
may evict and changes nothing itself: the tier calls ``on_remove`` once it really removed the entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvtier.keys import ChunkHash


class EvictionPolicy(Protocol):
    def on_insert(self, key: ChunkHash) -> None:
        """A new entry became visible."""

    def on_access(self, key: ChunkHash) -> None:
        """An entry was read or re-stored."""

    def on_remove(self, key: ChunkHash) -> None:
        """An entry left the tier (evicted or deleted). Unknown keys are ignored."""

    def victim(self, evictable: Callable[[ChunkHash], bool]) -> ChunkHash | None:
        """The key to evict next among those ``evictable`` accepts, or None. Mutates nothing."""

    def __len__(self) -> int: ...
