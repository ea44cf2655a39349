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

Chain order: a chunk whose predecessor is gone can never hit again, so a request's chunks must leave a tier
deepest first. Tiers report a batch of a request's chunks deepest first, but a request's chunks reach a tier
in several batches (the pipeline's windows, loaded in parallel; a retrieve's prefix, then a store's rest), so
once a retrieve or a store is done KVCache passes its whole chain to ``on_chain`` (through the tier's
``order_chain``): the policy then holds those keys deepest first among themselves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kvtier.base.keys import ChunkHash


class EvictionPolicy(Protocol):
    def on_insert(self, key: ChunkHash) -> None:
        """A new entry became visible."""

    def on_access(self, key: ChunkHash) -> None:
        """An entry was read or re-stored."""

    def on_remove(self, key: ChunkHash) -> None:
        """An entry left the tier (evicted or deleted). Unknown keys are ignored."""

    def on_chain(self, keys: Sequence[ChunkHash]) -> None:
        """``keys``, one request's chunks in chain order (root first), were just used: order them so that,
        among themselves, deeper keys are evicted first. Recency policies move each held key to the young end
        of the list it sits in, deepest first (the request just used them all); no use is counted (nothing is
        promoted, no frequency grows). Unknown keys are ignored. O(len(keys))."""

    def victim(self, evictable: Callable[[ChunkHash], bool]) -> ChunkHash | None:
        """The key to evict next among those ``evictable`` accepts, or None. Mutates nothing."""

    def __len__(self) -> int: ...


def renew_in_order(queues: Sequence[OrderedDict[ChunkHash, Any]], keys: Sequence[ChunkHash]) -> None:
    """``on_chain`` for queues in eviction order (oldest first): each key held moves to its queue's young
    end, the deepest first, so the root ends youngest."""
    for key in reversed(keys):
        for queue in queues:
            if key in queue:
                queue.move_to_end(key)
                break


def first_evictable(keys: Iterable[ChunkHash], evictable: Callable[[ChunkHash], bool]) -> ChunkHash | None:
    """The first of ``keys`` (in eviction order) that ``evictable`` accepts, or None."""
    for key in keys:
        if evictable(key):
            return key
    return None
