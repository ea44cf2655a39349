"""Where the router believes prefixes are: per replica and tier, precisely (events) or approximately (own record).

* ``ReplicaHoldings`` follows one replica's event stream (kvtier.events.subscriber feeds it): a key set per
  tier of the replica, in the replica's tier order. A tier that is a shared store (Redis) is not held here
  but in the ``SharedStores`` of the whole fleet, so a chunk any replica stored there counts for every replica
  that reads that store. Shared stores evict silently, so their entries expire after ``shared_ttl_s``.
* ``RecentRecord`` is the router's own record of which prefixes it sent where, with a time to live: the whole
  truth for replicas that publish no events, and for the others the chunks of requests still in flight
  (their stores are reported only once they are done).

What a replica's stream can make the router hold is bounded (a replica may be compromised):

* tiers: a replica's tiers are those its snapshot names (at most ``wire.MAX_TIERS``, names of at most 64
  characters); an event naming any other tier is dropped and counted, so /metrics has a bounded set of labels;
* keys: a replica's own tiers hold at most ``max_replica_keys`` keys in all; the eviction rule is "first learnt
  stays": a store beyond the cap is dropped and counted (``dropped``), a snapshot beyond it keeps its fastest
  tiers first. A replica that floods stores only loses precision about itself (its later chunks count as
  misses), never the router's memory nor the other replicas' entries. ``FleetIndex`` splits its total cap
  ``max_keys`` evenly among the replicas it was sized for;
* shared stores: at most ``max_stores`` store ids, each an ``ExpiringKeys`` of at most ``max_keys`` keys
  (oldest out first); a snapshot naming more stores has those tiers ignored;
* an ejected replica's holdings and record are freed (``FleetIndex.forget``); its snapshot, when it is back,
  says again what it holds;
* a snapshot is turned into key sets by ``ReplicaHoldings.prepare`` in a worker thread (see the subscriber),
  its keys decoded in pieces (``wire.snapshot_keys``); only the swap is done on the event loop, and the
  shared stores' keys are added there ``wire.KEYS_PIECE`` per turn.

What the router does with a replica's keys costs its event loop a bounded amount per turn, however many keys:
a tier's keys are a ``ShardedKeys``, shards of at most about ``SHARD_KEYS`` keys each (by Python's per-process
randomised hash of the key, so a replica cannot choose keys that pile into one; dicts the garbage collector
never tracks, so its full collections do not walk them), and keys replaced by a
snapshot or forgotten at an ejection are freed one shard per event-loop turn (``release``), not all at once
on the loop.

``FleetIndex.cached`` walks a request's chunk keys for one replica and returns how many leading chunks it
holds by tier (each in the fastest tier holding it; ``RECENT`` for the router's own record), stopping at the
first chunk it does not hold: what ``scoring.ReplicaView.cached`` wants, in chunks.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

from kvtier.base.keys import ChunkHash
from kvtier.events.wire import KEYS_PIECE, Batch, Snapshot, SnapshotHead, listed_keys, snapshot_keys

RECENT = "recent"  #: the tier name of the router's own record in views and metrics
SHARD_KEYS = 16_384  #: about the most keys one shard of a ``ShardedKeys`` holds at its cap


def in_turns(steps: list[Callable[[], object]]) -> None:
    """Run ``steps`` in order, one per turn of the running event loop (each a bounded piece of work, so the loop
    serves others between them); all of them at once when no loop runs in this thread."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        for step in steps:
            step()
        return
    queue = deque(steps)

    def turn() -> None:
        queue.popleft()()
        if queue:
            loop.call_soon(turn)

    if queue:
        loop.call_soon(turn)


def release(pieces: list) -> None:
    """Drop the objects in ``pieces`` (emptying it), one per event-loop turn (``in_turns``)."""
    in_turns([pieces.pop] * len(pieces))


class ShardedKeys:
    """A set of keys in shards (a power of two of them, so that ``cap`` keys make about ``SHARD_KEYS`` a shard),
    each shard freed on its own (``release``).

    A shard is a dict of key -> None, not a set: a set is always tracked by the cyclic garbage collector, and
    each full collection visited all 2M keys of a replica's sets (200 ms at idle, 650 ms under load, with the
    event loop stopped: the hostile run's E-3 flood triggered them). A dict that holds only bytes and None is
    never tracked, so a collection does not look at it at all."""

    def __init__(self, cap: int) -> None:
        count = 1
        while count * SHARD_KEYS < cap:
            count *= 2
        self._mask = count - 1
        self.shards: list[dict[ChunkHash, None]] = [{} for _ in range(count)]

    def add(self, key: ChunkHash) -> None:
        self.shards[hash(key) & self._mask][key] = None

    def update(self, keys: Iterable[ChunkHash]) -> None:
        shards, mask = self.shards, self._mask
        for key in keys:
            shards[hash(key) & mask][key] = None

    def discard(self, key: ChunkHash) -> None:
        self.shards[hash(key) & self._mask].pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self.shards[hash(key) & self._mask]

    def __len__(self) -> int:
        return sum(len(shard) for shard in self.shards)

    def __iter__(self) -> Iterator[ChunkHash]:
        for shard in self.shards:
            yield from shard

    def release(self) -> None:
        """Empty this set, its shards freed one per event-loop turn."""
        shards, self.shards = self.shards, [{} for _ in self.shards]
        release(shards)

    def clear(self) -> None:
        """Empty this set (as ``release``: a large one is freed over several loop turns)."""
        self.release()


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

    def __init__(self, ttl_s: float, max_keys: int, clock: Callable[[], float] = time.monotonic,
                 max_stores: int = 8) -> None:
        self.ttl_s, self.max_keys, self.max_stores, self._clock = ttl_s, max_keys, max_stores, clock
        self._stores: dict[str, ExpiringKeys] = {}

    def store(self, store_id: str) -> ExpiringKeys | None:
        """The keys of store ``store_id``; None when ``max_stores`` other stores are known already."""
        keys = self._stores.get(store_id)
        if keys is None:
            if len(self._stores) >= self.max_stores:
                return None
            keys = self._stores[store_id] = ExpiringKeys(self.ttl_s, self.max_keys, self._clock)
        return keys


@dataclass(frozen=True)
class PreparedSnapshot:
    """A snapshot turned into key sets within the caps (``ReplicaHoldings.prepare``), ready to swap in."""

    tiers: list[str]
    local: dict[str, ShardedKeys]
    shared: dict[str, tuple[str, list[ChunkHash]]]  #: tier name -> (store id, its keys)
    dropped: int


class ReplicaHoldings:
    """What one replica holds, per tier, as its event stream says (a ``HoldingsSink``)."""

    def __init__(self, shared: SharedStores, max_keys: int = 2_000_000) -> None:
        self._shared = shared
        self.max_keys = max_keys  #: keys in this replica's own tiers, in all
        self.tiers: list[str] = []  #: the replica's tiers, fastest first
        self._local: dict[str, ShardedKeys] = {}
        self._stores: dict[str, ExpiringKeys] = {}  # tier name -> the shared store it is
        self._held = 0  # keys in self._local, in all
        self.dropped = 0  #: stores dropped at the cap, and events naming a tier the snapshot did not
        self.synced = False

    def prepare(self, snapshot: Snapshot | SnapshotHead) -> PreparedSnapshot:
        """Key sets of ``snapshot`` within the cap, fastest tiers first, its keys decoded in pieces (a
        ``SnapshotHead``'s raw keys, or a ``Snapshot``'s lists); touches nothing (any thread)."""
        tiers, local, shared, room, dropped = [], {}, {}, self.max_keys, 0
        for tier in snapshot.tiers:
            if tier.name in tiers:
                continue
            tiers.append(tier.name)
            if tier.store_id is not None:
                shared[tier.name] = (tier.store_id, [ChunkHash(k) for piece in
                                                     snapshot_keys(tier.keys, self._shared.max_keys) for k in piece])
                continue
            held = ShardedKeys(self.max_keys)
            for piece in snapshot_keys(tier.keys, room):
                held.update(piece)
            local[tier.name] = held
            room -= len(held)
            dropped += max(listed_keys(tier.keys) - len(held), 0)
        return PreparedSnapshot(tiers, local, shared, dropped)

    def reset(self, snapshot: Snapshot | SnapshotHead | PreparedSnapshot) -> None:
        """Adopt a snapshot (prepared or not): what the replica holds now replaces what was known (the keys
        replaced are freed over the next event-loop turns)."""
        prepared = snapshot if isinstance(snapshot, PreparedSnapshot) else self.prepare(snapshot)
        self.release()
        self._local, self._stores = prepared.local, {}
        self._held = sum(len(keys) for keys in prepared.local.values())
        self.dropped += prepared.dropped
        for name, (store_id, keys) in prepared.shared.items():
            store = self._shared.store(store_id)
            if store is None:
                self.dropped += len(keys)
                continue
            self._stores[name] = store
            in_turns([partial(store.add, keys[i: i + KEYS_PIECE]) for i in range(0, len(keys), KEYS_PIECE)])
        self.tiers = [name for name in prepared.tiers if name in self._local or name in self._stores]
        self.synced = True

    def release(self) -> None:
        """Forget this replica's own tiers' keys, freed one shard per event-loop turn."""
        for keys in self._local.values():
            keys.release()
        self._local, self._held = {}, 0

    def apply(self, batch: Batch) -> None:
        for event in batch.events:
            key = ChunkHash(event.key)
            store = self._stores.get(event.tier)
            if store is not None:
                store.add([key]) if event.stored else store.discard(key)
                continue
            held = self._local.get(event.tier)
            if held is None:  # a tier the snapshot did not name: not one of this replica's
                self.dropped += 1
            elif not event.stored:
                if key in held:
                    held.discard(key)
                    self._held -= 1
            elif key not in held:
                if self._held >= self.max_keys:
                    self.dropped += 1
                else:
                    held.add(key)
                    self._held += 1

    def clear(self, tier: str) -> None:
        """Forget what the replica's own tier ``tier`` holds (vLLM's ``AllBlocksCleared`` for its device cache)."""
        held = self._local.get(tier)
        if held is not None:
            self._held -= len(held)
            held.clear()

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
                 shared_ttl_s: float = 3600.0, max_keys: int = 1_000_000, max_replica_keys: int = 2_000_000,
                 max_total_keys: int = 8_000_000, replicas: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``max_keys``: the router's own record per replica and each shared store; ``max_total_keys``: all
        replicas' precise holdings, split evenly among ``replicas`` (at most ``max_replica_keys`` each)."""
        self.recent_ttl_s, self.in_flight_ttl_s, self.max_keys = recent_ttl_s, in_flight_ttl_s, max_keys
        self.max_replica_keys = min(max_replica_keys, max_total_keys // max(replicas, 1))
        self._clock = clock
        self.shared = SharedStores(shared_ttl_s, max_keys, clock)
        self._holdings: dict[str, ReplicaHoldings] = {}
        self._recent: dict[str, ExpiringKeys] = {}

    def holdings(self, replica: str) -> ReplicaHoldings:
        """The precise record of ``replica`` (created empty and unsynced on first use)."""
        held = self._holdings.get(replica)
        if held is None:
            held = self._holdings[replica] = ReplicaHoldings(self.shared, self.max_replica_keys)
        return held

    def forget(self, replica: str) -> None:
        """``replica`` was ejected: free what is known of it (its snapshot says it all again when it is back);
        its keys are freed over the next event-loop turns."""
        held = self._holdings.pop(replica, None)
        if held is not None:
            held.release()
        self._recent.pop(replica, None)

    def dropped(self, replica: str) -> int:
        """Events of ``replica`` dropped at its cap or for naming a tier it does not have."""
        held = self._holdings.get(replica)
        return held.dropped if held is not None else 0

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
