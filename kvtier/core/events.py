"""What a KVCache tells the world about where chunks are: stored / removed events per tier, and snapshots.

``CacheEvents`` is the hub one ``KVCache`` owns (``cache.events``); its ``TierChain`` reports every entry that
enters a tier, by one rule for chunks, segments and state snapshots alike:

* each entry newly written into a tier is one ``STORED`` event carrying its ``EntryKind``;
* a chunk a request stored (``stored``) also carries its chain position, parent and token ids; an entry of
  any kind that moved between tiers (promoted from a slower one) or a segment or snapshot carries none;
* an entry demoted into a write-back tier when the tier above evicted it has ``entry=None``: a blob does not
  record its kind, and eviction hands the chain nothing but the key and the blob;
* every tier that is a ``RemovalReporter`` reports the keys that leave it (evicted, deleted, lost) as
  ``REMOVED`` events with ``entry=None``, for the same reason.

Subscribers get batches of ``ChunkEvent`` synchronously, in the thread that caused them, often while a tier
holds its lock: a subscriber must be quick (append to a queue), must not call into the cache and must not raise.

Ordering: events of one tier arrive in the order the tier changed, except that a store's event is emitted
just after ``put`` returns, so a chunk evicted by another thread in between may be reported removed before it
is reported stored. Consumers that need exactness resynchronise from a ``Holdings`` snapshot now and then.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier.base.keys import NO_EXTRAS, ChunkHash, ExtraKeys, SpanKey

if TYPE_CHECKING:  # the tiers (and torch under them) are loaded by whoever holds tiers, never by a router
    from kvtier.tiers import Tier

log = logging.getLogger(__name__)


class ChunkEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


class EntryKind(enum.Enum):
    """What an entry in a tier is: a prefix chunk of KV, a whole segment of KV, or one kind of a state snapshot."""

    CHUNK = "chunk"
    SEGMENT = "segment"
    SNAPSHOT = "snapshot"


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """One chunk arriving in or leaving one tier.

    ``position`` is the chunk's index in its chain (0: the first chunk of a prompt) and ``parent`` the key
    before it (None at position 0); both None where the cache does not know them (removals, chunks moved
    between tiers by eviction). ``tokens`` are the chunk's token ids (little-endian uint32) for stores.
    ``entry`` is the kind of entry where the chain knows it, None where a tier moved or dropped the entry on its
    own (removals, demotions on eviction): see the rule at the top of this module. ``extras``: for stores, the
    span keys (kvtier.base.keys.ExtraKeys) folded into the chunk's key, in their order.
    """

    kind: ChunkEventKind
    tier: str
    key: ChunkHash
    position: int | None = None
    parent: ChunkHash | None = None
    tokens: bytes | None = None
    entry: EntryKind | None = None
    extras: tuple[SpanKey, ...] = ()


Subscriber = Callable[[Sequence[ChunkEvent]], None]


@dataclass(frozen=True)
class TierHolding:
    """What one tier holds: its keys (None when the tier cannot list them) and, for a shared store, its id."""

    name: str
    keys: list[ChunkHash] | None
    store_id: str | None = None


class CacheEvents:
    """The event hub of one cache. Thread-safe; costs one attribute read per store when nobody subscribes."""

    def __init__(self) -> None:
        self._subscribers: tuple[Subscriber, ...] = ()
        self._lock = threading.Lock()

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber`` with every batch from now on; returns the function that unsubscribes it."""
        with self._lock:
            self._subscribers = (*self._subscribers, subscriber)

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = tuple(s for s in self._subscribers if s is not subscriber)

        return unsubscribe

    def watch(self, tiers: Sequence[Tier]) -> None:
        """Report the removals of every tier that can tell them."""
        from kvtier.tiers import RemovalReporter

        for tier in tiers:
            if isinstance(tier, RemovalReporter):
                tier.set_removal_listener(lambda key, name=tier.name: self._removed(name, key))

    def stored(self, tier: str, keys: Sequence[ChunkHash], indices: Sequence[int],
               token_ids: np.ndarray | None = None, chunk_size: int = 0, extras: ExtraKeys = NO_EXTRAS) -> None:
        """Chunks ``keys[i]`` for ``i`` in ``indices`` are now in ``tier`` (``keys`` is their whole chain, derived
        with ``extras``)."""
        subscribers = self._subscribers
        if not subscribers or not indices:
            return
        events = [ChunkEvent(ChunkEventKind.STORED, tier, keys[i], i, keys[i - 1] if i else None,
                             _chunk_tokens(token_ids, i, chunk_size), EntryKind.CHUNK,
                             tuple(extras.overlapping(i * chunk_size, (i + 1) * chunk_size)) if extras else ())
                  for i in indices]
        self._emit(subscribers, events)

    def entered(self, tier: str, keys: Sequence[ChunkHash], entry: EntryKind | None) -> None:
        """Entries of no known chain position are now in ``tier``: segments and snapshots a request stored,
        entries promoted from a slower tier, and (``entry=None``) entries demoted from a faster one."""
        subscribers = self._subscribers
        if subscribers and keys:
            self._emit(subscribers, [ChunkEvent(ChunkEventKind.STORED, tier, key, entry=entry) for key in keys])

    def _removed(self, tier: str, key: ChunkHash) -> None:
        if self._subscribers:
            self._emit(self._subscribers, [ChunkEvent(ChunkEventKind.REMOVED, tier, key)])

    @staticmethod
    def _emit(subscribers: tuple[Subscriber, ...], events: list[ChunkEvent]) -> None:
        for subscriber in subscribers:
            subscriber(events)


def _chunk_tokens(token_ids: np.ndarray | None, i: int, chunk_size: int) -> bytes | None:
    if token_ids is None or not chunk_size:
        return None
    return token_ids[i * chunk_size : (i + 1) * chunk_size].tobytes()


def holdings(tiers: Sequence[Tier]) -> list[TierHolding]:
    """What each tier holds now, fastest first: the body of a snapshot."""
    from kvtier.tiers import Listable, SharedStore

    out = []
    for tier in tiers:
        keys = tier.list_keys() if isinstance(tier, Listable) else None
        store = tier.store_id if isinstance(tier, SharedStore) else None
        out.append(TierHolding(tier.name, keys, store))
    return out
