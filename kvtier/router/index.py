"""Where the router believes prefixes are: per replica and tier, precisely (events) or approximately (own record).

* ``ReplicaHoldings`` follows one replica's event stream (kvtier.events.subscriber feeds it): a key set per
  tier of the replica, in the replica's tier order. A tier that is a shared store (Redis) is not held here
  but in the ``SharedStores`` of the whole fleet, so a chunk any replica stored there counts for every replica
  that reads that store. Shared stores evict silently, so their entries expire after ``shared_ttl_s``.
* ``RecentRecord`` is the router's own record of which prefixes it sent where, with a time to live: the whole
  truth for replicas that publish no events, and for the others the chunks of requests still in flight
  (their stores are reported only once they are done).

``FleetIndex.cached`` walks a request's chunk keys for one replica and returns how many leading chunks it
holds by tier (each in the fastest tier holding it; ``RECENT`` for the router's own record), stopping at the
first chunk it does not hold: what ``scoring.ReplicaView.cached`` wants, in chunks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.events.wire import Batch, Snapshot
from kvtier.keys import ChunkHash

RECENT = "recent"  #: the tier name of the router's own record in views and metrics


class ExpiringKeys:
    """Keys with a deadline, oldest first, at most ``max_keys`` (the oldest go first beyond that)."""

    def __init__(self, ttl_s: float, max_keys: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_keys, self._clock = ttl_s, max_keys, clock
        self._keys: OrderedDict[ChunkHash, float] = OrderedDict()

    def add(self, keys: Sequence[ChunkHash], ttl_s: float | None = None) -> None:
        """Add (or refresh) ``keys`` for ``ttl_s`` seconds (default: the set's own)."""
        deadline = self._clock() + (self.ttl_s if ttl_s is None else ttl_s)
        for key in keys:
            self._keys[key] = deadline
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def discard(self, key: ChunkHash) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: ChunkHash) -> bool:
        deadline = self._keys.get(key)
        if deadline is None:
            return False
        if deadline < self._clock():
            self._expire()
            return False
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._keys)

    def _expire(self) -> None:
        now = self._clock()
        while self._keys:
            key, deadline = next(iter(self._keys.items()))
            if deadline >= now:
                return
            self._keys.popitem(last=False)


class SharedStores:
    """Chunks in shared stores (by ``store_id``), learnt from any replica's events; they expire."""

    def __init__(self, ttl_s: float, max_keys: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_keys, self._clock = ttl_s, max_keys, clock
        self._stores: dict[str, ExpiringKeys] = {}

    def store(self, store_id: str) -> ExpiringKeys:
        keys = self._stores.get(store_id)
        if keys is None:
            keys = self._stores[store_id] = ExpiringKeys(self.ttl_s, self.max_keys, self._clock)
        return keys


class ReplicaHoldings:
    """What one replica holds, per tier, as its event stream says (a ``HoldingsSink``)."""

    def __init__(self, shared: SharedStores) -> None:
        self._shared = shared
        self.tiers: list[str] = []  #: the replica's tiers, fastest first
        self._local: dict[str, set[ChunkHash]] = {}
        self._stores: dict[str, ExpiringKeys] = {}  # tier name -> the shared store it is
        self.synced = False

    def reset(self, snapshot: Snapshot) -> None:
        self.tiers = [tier.name for tier in snapshot.tiers]
        self._local, self._stores = {}, {}
        for tier in snapshot.tiers:
            if tier.store_id is not None:
                self._stores[tier.name] = store = self._shared.store(tier.store_id)
                store.add([ChunkHash(k) for k in tier.keys or ()])
            else:
                self._local[tier.name] = {ChunkHash(k) for k in tier.keys or ()}
        self.synced = True

    def apply(self, batch: Batch) -> None:
        for event in batch.events:
            key = ChunkHash(event.key)
            store = self._stores.get(event.tier)
            if store is not None:
                store.add([key]) if event.stored else store.discard(key)
                continue
            held = self._local.get(event.tier)
            if held is None:  # a tier the snapshot did not name: keep it, slowest
                self.tiers.append(event.tier)
                held = self._local[event.tier] = set()
            held.add(key) if event.stored else held.discard(key)

    def tier_of(self, key: ChunkHash) -> str | None:
        """The fastest tier holding ``key``, or None."""
        for name in self.tiers:
            held = self._local.get(name)
            if (held is not None and key in held) or (held is None and key in self._stores.get(name, ())):
                return name
        return None

    def chunks(self) -> dict[str, int]:
        """Chunks held per tier (shared stores: those known to this router)."""
        return {name: len(self._local[name]) if name in self._local else len(self._stores[name])
                for name in self.tiers if name in self._local or name in self._stores}


class FleetIndex:
    """Holdings (precise) and the recent record (approximate) of every replica, by replica name."""

    def __init__(self, *, recent_ttl_s: float = 600.0, in_flight_ttl_s: float = 60.0,
                 shared_ttl_s: float = 3600.0, max_keys: int = 1_000_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.recent_ttl_s, self.in_flight_ttl_s, self.max_keys = recent_ttl_s, in_flight_ttl_s, max_keys
        self._clock = clock
        self.shared = SharedStores(shared_ttl_s, max_keys, clock)
        self._holdings: dict[str, ReplicaHoldings] = {}
        self._recent: dict[str, ExpiringKeys] = {}

    def holdings(self, replica: str) -> ReplicaHoldings:
        """The precise record of ``replica`` (created empty and unsynced on first use)."""
        held = self._holdings.get(replica)
        if held is None:
            held = self._holdings[replica] = ReplicaHoldings(self.shared)
        return held

    def record(self, replica: str, keys: Sequence[ChunkHash]) -> None:
        """``keys`` were sent to ``replica``: it will hold them soon (if it caches at all)."""
        recent = self._recent.get(replica)
        if recent is None:
            recent = self._recent[replica] = ExpiringKeys(self.recent_ttl_s, self.max_keys, self._clock)
        precise = replica in self._holdings and self._holdings[replica].synced
        recent.add(keys, self.in_flight_ttl_s if precise else self.recent_ttl_s)

    def restarted(self, replica: str) -> None:
        """``replica`` restarted: what the router sent it before says nothing of what it holds now."""
        self._recent.pop(replica, None)

    def cached(self, replica: str, keys: Sequence[ChunkHash]) -> dict[str, int]:
        """Leading chunks of ``keys`` the replica holds, by tier (each chunk counted in its fastest tier)."""
        held = self._holdings.get(replica)
        recent = self._recent.get(replica)
        out: dict[str, int] = {}
        for key in keys:
            tier = held.tier_of(key) if held is not None and held.synced else None
            if tier is None and recent is not None and key in recent:
                tier = RECENT
            if tier is None:
                break
            out[tier] = out.get(tier, 0) + 1
        return out

    def chunks(self, replica: str) -> dict[str, int]:
        """What the index holds for ``replica``, per tier (for the metrics)."""
        held = self._holdings.get(replica)
        out = held.chunks() if held is not None and held.synced else {}
        if replica in self._recent:
            out[RECENT] = len(self._recent[replica])
        return out
