"""The eviction policy protocol: bookkeeping hooks plus one decision hook.

The tier owns the bytes and the accounting; the policy only orders keys. ``victim`` proposes a key the tier
may evict and changes nothing itself: the tier calls ``on_remove`` once it really removed the entry.

Contracts every policy keeps (``tests/conformance/policy_suite.py`` checks them):

* ``victim`` never proposes a key that ``evictable`` rejects (pinned entries stay) and, called any number of
  times, changes nothing: neither what later calls return nor the policy's size.
* Deterministic: the same sequence of calls gives the same victims, in every process.
* Memory is bounded by a constant times the most entries the tier ever held (ghost lists and sketches
  included), whatever the number of distinct keys that passed through.
* Every hook is O(1) amortised (``victim`` too, apart from skipping pinned keys).
* Not thread-safe by itself: the tier calls every hook under its own lock.

Chain order: within one batch of a request's chunks, the tier reports touches deepest chunk first, so a
policy that breaks ties by order of touch evicts a chain from its end (a chunk whose predecessor is gone can
never hit again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def first_evictable(keys: Iterable[ChunkHash], evictable: Callable[[ChunkHash], bool]) -> ChunkHash | None:
    """The first of ``keys`` (in eviction order) that ``evictable`` accepts, or None."""
    for key in keys:
        if evictable(key):
            return key
    return None
