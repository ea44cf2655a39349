"""Memory tier: one preallocated buffer, views handed out, eviction through a policy.

The buffer is allocated (and its pages touched) once at start, in host RAM (pinned when CUDA is available so
host<->GPU copies can be asynchronous, on transparent huge pages otherwise) or, with ``device: cuda:N``, in a
GPU's spare memory (slab.py). A chunk is written straight into its slot (``Payload.write_into``) and read as a
view of its slot: one copy in, one copy out, no per-chunk allocation of bytes (a GPU buffer adds a host copy
each way).

The buffer is private to the process, so blobs here are stored unsealed and read without checksum
(``verifies = False``); their headers and token ids are still checked by the cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvtier.base.keys import ChunkHash
from kvtier.codecs import Payload, get_codec
from kvtier.native.allocator import Allocator
from kvtier.policy import make_policy
from kvtier.tiers.base import EvictionListener, RemovalListener, TierContext, TierStats, stats_gauges
from kvtier.tiers.control import DEFAULT_TAGS, Feature, Tags, TierUsage
from kvtier.tiers.ledger import Ledger
from kvtier.tiers.memory.config import MemoryTierConfig
from kvtier.tiers.metrics import EVICTIONS, EXPIRED, SKIPPED_STORES, WRITTEN_BYTES
from kvtier.tiers.slab import make_slab


class _Entry:
    __slots__ = ("offset", "nbytes", "pins", "doomed")

    def __init__(self, offset: int, nbytes: int) -> None:
        self.offset, self.nbytes, self.pins, self.doomed = offset, nbytes, 0, False


class MemoryTier:
    """The Tier protocol over one preallocated host buffer; an ``EvictionReporter``, ``ChainOrdered``, a
    ``RemovalReporter``, ``Listable``, ``Controlled`` (pins, expiry, tenant shares: kvtier/tiers/control.py) and
    ``EvictionTags``."""

    verifies = False
    supports = frozenset(Feature)
    #: a get costs no round trip: fewer, larger windows spare a long load thread hand-offs (kvtier.core.pipeline)
    large_load_windows = True

    def __init__(self, config: MemoryTierConfig, ctx: TierContext) -> None:
        self.name = ctx.name
        self.codec = get_codec(config.codec)
        self._policy = make_policy(config.policy)
        self._metrics = ctx.metrics
        self._alloc = Allocator(config.capacity_bytes, align=64)  # blob payloads start 64-byte aligned
        self._slab = make_slab(self._alloc.capacity, config.device, config.prefault, config.huge_pages)
        self._buffer = self._slab.buffer
        self._entries: dict[ChunkHash, _Entry] = {}
        self._lock = threading.Lock()
        self._on_evict: EvictionListener | None = None
        self._closed = False
        self._on_remove: RemovalListener | None = None
        self._config, self._ctx = config, ctx
        self._ledger = Ledger(config, self._alloc.capacity, ctx)
        self._evicting = threading.local()  #: the tags of the entry being evicted, for the eviction listener
        self._metrics.add_gauges(self._gauges)

    # -- the Tier protocol ---------------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkHash]) -> list[bool]:
        entries = self._entries
        with self._lock:
            self._sweep()
            return [key in entries and not self._expire(key) for key in keys]

    @contextmanager
    def get(self, keys: Sequence[ChunkHash]) -> Iterator[list[memoryview | None]]:
        pinned: list[_Entry] = []
        views: list[memoryview | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or self._expire(key):
                    views.append(None)
                    continue
                entry.pins += 1
                pinned.append(entry)
                views.append(self._slab.read(entry.offset, entry.nbytes))
            for key, view in zip(reversed(keys), reversed(views)):  # deepest chunk first (policy/base.py)
                if view is not None:
                    self._policy.on_access(key)
        try:
            yield views
        finally:
            with self._lock:
                for entry in pinned:
                    entry.pins -= 1
                    if entry.doomed and entry.pins == 0:
                        self._alloc.free(entry.offset, entry.nbytes)

    def put(self, items: Sequence[tuple[ChunkHash, Payload]]) -> list[bool]:
        return self.put_tagged(items, DEFAULT_TAGS)

    def put_tagged(self, items: Sequence[tuple[ChunkHash, Payload]], tags: Tags) -> list[bool]:
        """Stores a batch deepest chunk first, so the policy learns a chain from its end (policy/base.py).

        In three steps: slots are reserved (evicting as needed), then the payloads are written together (their
        bulk copies in one call: Python between the copies of a batch had slowed them by ~10%), then the
        entries are published. A reserved slot is in no entry, so nothing can evict or read it early. When
        the batch itself fills the tier, what is reserved so far is written and published first, so later
        chunks may evict it as they would one by one. ``tags`` (owner, expiry) go with every new entry; the
        owner's share counts the batch's reserved slots too."""
        done = [False] * len(items)
        pending: list[tuple[int, int, int, object]] = []  # (item index, offset, nbytes, slab)
        with self._lock:
            self._sweep()
        reserved = 0  # bytes of the pending slots, which the owner's share counts
        for i in reversed(range(len(items))):
            key, payload = items[i]
            slot = self._reserve(key, payload.nbytes, tags, reserved, last_try=not pending)
            if slot is None:  # full of pending slots: publish them (they become evictable) and try again
                self._commit(items, pending, done, tags)
                pending, reserved = [], 0
                slot = self._reserve(key, payload.nbytes, tags, 0, last_try=True)
            if isinstance(slot, tuple):
                pending.append((i, *slot))
                reserved += slot[1]
            else:
                done[i] = bool(slot)
        self._commit(items, pending, done, tags)
        return done

    def delete(self, keys: Sequence[ChunkHash]) -> None:
        with self._lock:
            for key in keys:
                self._remove(key)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self._alloc.used, self._alloc.capacity, len(self._entries))

    def close(self) -> None:
        """Forget every entry and give the buffer back now (a process that builds caches one after another
        must not hold every old buffer until garbage collection finds it). Views handed out earlier stay
        valid: they keep the old buffer alive until they are dropped. After close, puts are skipped and
        reads miss."""
        with self._lock:
            self._entries.clear()
            self._ledger = Ledger(self._config, self._alloc.capacity, self._ctx)
            self._closed = True
            self._slab = make_slab(0, "cpu", prefault=False)
            self._buffer = self._slab.buffer

    # -- ChainOrdered ---------------------------------------------------------------------------------------
    def order_chain(self, keys: Sequence[ChunkHash]) -> None:
        with self._lock:
            self._policy.on_chain(keys)

    # -- EvictionReporter ----------------------------------------------------------------------------------
    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        """See ``EvictionReporter``: called from ``put`` for each entry evicted to make room."""
        self._on_evict = listener

    # -- RemovalReporter and Listable ----------------------------------------------------------------------
    def set_removal_listener(self, listener: RemovalListener | None) -> None:
        """See ``RemovalReporter``: called under the tier's lock for each entry evicted or deleted."""
        self._on_remove = listener

    def list_keys(self) -> list[ChunkHash]:
        with self._lock:
            return list(self._entries)

    # -- internals -----------------------------------------------------------------------------------------
    def _reserve(self, key: ChunkHash, nbytes: int, tags: Tags, reserved: int, *,
                 last_try: bool) -> bool | tuple[int, int, object] | None:
        """A slot for ``key``: ``(offset, nbytes, slab)``; True (already stored) or False (skipped); None when no
        room could be made and this is not the ``last_try`` (the caller holds unpublished slots, ``reserved``
        bytes of the same owner)."""
        with self._lock:
            if self._closed:
                return False
            if key in self._entries:
                self._policy.on_access(key)
                return True
            if self._alloc.rounded(nbytes) > self._alloc.capacity:
                self._metrics.inc(SKIPPED_STORES, tier=self.name, reason="too_large")
                return False
            if not self._within_share(tags.tenant, nbytes + reserved):
                if not last_try:
                    return None
                self._metrics.inc(SKIPPED_STORES, tier=self.name, reason="over_quota")
                return False
            offset = self._allocate(nbytes)
            if offset is None:
                if not last_try:
                    return None
                self._metrics.inc(SKIPPED_STORES, tier=self.name, reason="full_of_pinned")
                return False
            return offset, nbytes, self._slab  # close() may swap the slab while the write runs: it lands in this one

    def _commit(self, items: Sequence[tuple[ChunkHash, Payload]], pending: list[tuple[int, int, int, object]],
                done: list[bool], tags: Tags) -> None:
        """Write the reserved slots' payloads (each into the slab it was reserved in), then publish them."""
        try:
            for slab in {id(p[3]): p[3] for p in pending}.values():  # one slab, unless close() swapped it
                slab.write_many([(offset, items[i][1]) for i, offset, _, s in pending if s is slab])
        except BaseException:
            with self._lock:
                for _, offset, nbytes, _ in pending:
                    self._alloc.free(offset, nbytes)
            raise
        with self._lock:
            for i, offset, nbytes, _ in pending:
                done[i] = self._publish(items[i][0], offset, nbytes, tags)
        written = sum(nbytes for i, _, nbytes, _ in pending if done[i])
        if written:
            self._metrics.inc(WRITTEN_BYTES, written, tier=self.name)

    def _publish(self, key: ChunkHash, offset: int, nbytes: int, tags: Tags) -> bool:
        """Make a written slot ``key``'s entry. Caller holds the lock."""
        if self._closed:
            return False
        if key in self._entries:  # a concurrent put of the same key won
            self._alloc.free(offset, nbytes)
            return True
        self._entries[key] = _Entry(offset, nbytes)
        self._ledger.add(key, nbytes, tags)
        self._policy.on_insert(key)
        return True

    def _allocate(self, nbytes: int) -> int | None:
        """Find room, evicting unpinned entries in policy order. Caller holds the lock."""
        while (offset := self._alloc.alloc(nbytes)) is None:
            over = self._ledger.over_filter()  # tenants past their share give room first
            if not (over is not None and self._evict(lambda k: over(k) and self._evictable(k))) \
                    and not self._evict(self._evictable):
                return None
        return offset

    def _evictable(self, key: ChunkHash) -> bool:
        return self._entries[key].pins == 0 and not self._ledger.pinned(key)

    def _evict(self, evictable: Callable[[ChunkHash], bool]) -> bool:
        """Evict the policy's victim among ``evictable`` keys; False if there is none. Caller holds the lock."""
        victim = self._policy.victim(evictable)
        if victim is None:
            return False
        entry = self._entries[victim]
        if self._on_evict is not None:
            self._evicting.tags = self._ledger.tags(victim)
            try:
                self._on_evict(victim, self._slab.read(entry.offset, entry.nbytes))
            finally:
                self._evicting.tags = None
        self._remove(victim)
        self._metrics.inc(EVICTIONS, tier=self.name)
        return True

    def _within_share(self, tenant: str, nbytes: int) -> bool:
        """Make room within ``tenant``'s share for ``nbytes`` more, evicting its own entries first (policy order);
        False if it cannot. Caller holds the lock."""
        owned = self._ledger.owned_by(tenant)
        while self._ledger.over_share(tenant, nbytes):
            if not self._evict(lambda k: owned(k) and self._evictable(k)):
                return False
        return True

    def _expire(self, key: ChunkHash) -> bool:
        """Reclaim ``key`` if its retention time passed; True if it did. Caller holds the lock."""
        if not self._ledger.expired(key):
            return False
        self._remove(key)
        self._metrics.inc(EXPIRED, tier=self.name)
        return True

    def _sweep(self) -> None:
        """One step of the sweep of expired entries (kvtier/tiers/ledger.py). Caller holds the lock."""
        for key in self._ledger.due():
            self._remove(key)
            self._metrics.inc(EXPIRED, tier=self.name)

    def _remove(self, key: ChunkHash) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._policy.on_remove(key)
        self._ledger.drop(key)
        if self._on_remove is not None:
            self._on_remove(key)
        if entry.pins:
            entry.doomed = True  # freed by the last reader
        else:
            self._alloc.free(entry.offset, entry.nbytes)

    # -- Controlled (kvtier/tiers/control.py) -------------------------------------------------------------
    def tags_of(self, keys: Sequence[ChunkHash]) -> list[Tags | None]:
        with self._lock:
            return [self._ledger.tags(key) for key in keys]

    def pin(self, keys: Sequence[ChunkHash]) -> int:
        with self._lock:
            return self._ledger.pin([key for key in keys if key in self._entries and not self._expire(key)])

    def unpin(self, keys: Sequence[ChunkHash]) -> int:
        with self._lock:
            return self._ledger.unpin(keys)

    def pinned(self, keys: Sequence[ChunkHash]) -> list[bool]:
        with self._lock:
            return [self._ledger.pinned(key) for key in keys]

    def evicting_tags(self) -> Tags | None:
        """``EvictionTags``: the tags of the entry whose eviction this thread is reporting now."""
        return getattr(self._evicting, "tags", None)

    def clear(self, *, tenant: str | None = None, everything: bool = False) -> int:
        """The tier belongs to one cache, so its namespace is everything it holds."""
        with self._lock:
            doomed = self._ledger.keys_of(None if everything else tenant)
            for key in doomed:
                self._remove(key)
            return len(doomed)

    def usage(self) -> TierUsage:
        with self._lock:
            return self._ledger.usage(len(self._entries), self._alloc.used)

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        yield from stats_gauges(self)
        with self._lock:
            yield from list(self._ledger.gauges())
