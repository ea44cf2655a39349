"""The disk tier's index: which chunks it holds, their sizes, pins, eviction order and queued writes. No I/O.

The index decides; the tier's writer threads move bytes. Every decision that changes a file (store a chunk,
remove one) is handed to ``submit_write`` / ``submit_unlink`` *while the index lock is held*, so the writers
receive the file operations of one key in exactly the order the index made them: a chunk evicted and then
stored again is unlinked before it is rewritten, never after.

An entry is *pending* from ``reserve`` until its writer ``publish``-es it: it counts against the capacity
and a second store of the key is a no-op, but it is not visible (``contains`` False, ``pin`` skips it), so a
chunk is visible only once its file is complete.

Every entry that leaves the index (evicted, deleted, forgotten, or a queued store abandoned) is reported to
``on_drop`` (the tier's RemovalReporter listener), under the index lock.

Eviction order. ``reserve`` takes a batch in chain order (a request's chunks, root first), so that a full
write queue drops the deepest chunks, and reports the batch to the policy deepest chunk first (policy/base.py):
a pending entry is known to the policy from its reservation, never proposed as a victim, and goes on in the
order decided when its file lands. Each reservation carries ``stamp_ns``, deeper chunks older, which the
writer sets as the file's mtime, as reads do for what they read: a restart re-indexes files oldest mtime
first, so the policy starts again from the order of last use. A request's chunks come in several batches,
each stamped on its own, so ``order_chain`` stamps the whole chain again (``submit_touch``, after any
queued write of the same key), deeper chunks older, as it orders the policy.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvtier.base.keys import ChunkHash
from kvtier.base.metrics import Metrics
from kvtier.policy import EvictionPolicy
from kvtier.tiers.base import RemovalListener, TierStats
from kvtier.tiers.control import DEFAULT_TAGS, Tags, TierUsage
from kvtier.tiers.ledger import Ledger
from kvtier.tiers.metrics import EVICTIONS, EXPIRED

#: Apart from each other, the mtimes of one batch: files of one request keep their order on any filesystem
#: whose timestamps have microseconds (ext4, xfs, btrfs, tmpfs: nanoseconds).
STAMP_STEP_NS = 1_000


def stamps_ns(n: int) -> list[int]:
    """File times for a batch of ``n`` chunks in chain order: now for the root, a step earlier for each
    deeper chunk, so a restart (oldest mtime first) reports the chain deepest first, as it was used."""
    now = time.time_ns()
    return [now - i * STAMP_STEP_NS for i in range(n)]


class Declined(enum.Enum):
    """Why ``reserve`` started no new store. PRESENT means nothing is needed (the key is stored or queued); the
    others say why the store is skipped, their value being the ``reason`` label of kvtier_skipped_stores_total."""

    PRESENT = "present"
    CLOSED = "closed"
    TOO_LARGE = "too_large"
    QUEUE_FULL = "queue_full"
    FULL_OF_PINNED = "full_of_pinned"
    OVER_QUOTA = "over_quota"


class Pending:
    """A reserved store. ``ready`` is set once ``buf`` holds the payload (``buf`` stays None if the copy failed);
    ``stamp_ns`` is the mtime its file gets, ``tags`` the owner and expiry its file's name records."""

    __slots__ = ("buf", "cancelled", "key", "nbytes", "ready", "stamp_ns", "tags")

    def __init__(self, key: ChunkHash, nbytes: int, stamp_ns: int, tags: Tags = DEFAULT_TAGS) -> None:
        self.key, self.nbytes, self.buf, self.cancelled, self.stamp_ns = key, nbytes, None, False, stamp_ns
        self.tags = tags
        self.ready = threading.Event()


class Entry:
    """A chunk held or being written; ``tags``: those its file's name records (files.py), which is where it is."""

    __slots__ = ("nbytes", "pending", "pins", "tags")

    def __init__(self, nbytes: int, pending: Pending | None = None, tags: Tags = DEFAULT_TAGS) -> None:
        self.nbytes, self.pins, self.pending, self.tags = nbytes, 0, pending, tags


class DiskIndex:
    """Thread-safe. ``used`` counts stored and pending bytes and never exceeds ``capacity``.

    Cache control (kvtier/tiers/control.py) lives in ``ledger``: owners and expiries are recorded at
    reservation (a pending entry counts against its owner's share), entries pinned there are never evicted,
    and an expired entry is dropped (its file unlinked) when ``contains`` or ``pin`` finds it, or by the
    sweep that ``reserve`` and ``contains`` advance.
    """

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy,
        *,
        queue_depth: int,
        submit_write: Callable[[Pending], None],
        submit_unlink: Callable[[ChunkHash, Tags], None],
        submit_touch: Callable[[ChunkHash, Tags, int], None],
        metrics: Metrics,
        name: str,
        ledger: Ledger,
    ) -> None:
        self.capacity = capacity
        self._policy = policy
        self._depth = queue_depth
        self._submit_write, self._submit_unlink, self._submit_touch = submit_write, submit_unlink, submit_touch
        self._lock = threading.Lock()
        self._entries: dict[ChunkHash, Entry] = {}
        self.used = 0
        self.queued = 0  #: pending stores not yet published or abandoned
        self.closed = False  #: no more file operations are submitted
        self._metrics, self._name = metrics, name
        self.on_drop: RemovalListener | None = None  #: told of every key that leaves the index
        self.ledger = ledger

    # -- queries -------------------------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkHash]) -> list[bool]:
        entries = self._entries
        with self._lock:
            self._sweep()
            return [(e := entries.get(key)) is not None and e.pending is None and not self._expire(key)
                    for key in keys]

    def pin(self, keys: Sequence[ChunkHash]) -> list[tuple[int, ChunkHash, Entry]]:
        """Pin the visible entries among ``keys``: ``(position, key, entry)``; pass the entries to ``unpin``."""
        out = []
        with self._lock:
            if self.closed:
                return out
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is not None and entry.pending is None and not self._expire(key):
                    entry.pins += 1
                    out.append((i, key, entry))
            for _, key, _ in reversed(out):  # deepest chunk first
                self._policy.on_access(key)
        return out

    def order_chain(self, keys: Sequence[ChunkHash]) -> None:
        """The policy's ``on_chain``, and the files' mtimes in the same order (see the module docstring)."""
        with self._lock:
            if self.closed:
                return
            self._policy.on_chain(keys)
            held = [(key, entry.tags) for key in keys if (entry := self._entries.get(key)) is not None]
            for (key, tags), stamp in zip(held, stamps_ns(len(held))):
                self._submit_touch(key, tags, stamp)

    def unpin(self, entries: Iterable[Entry]) -> None:
        with self._lock:
            for entry in entries:
                entry.pins -= 1

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.used, self.capacity, len(self._entries))

    def keys(self) -> list[ChunkHash]:
        """Stored and queued keys (a queued store that fails is reported to ``on_drop``)."""
        with self._lock:
            return list(self._entries)

    # -- stores --------------------------------------------------------------------------------------------
    def reserve(self, items: Sequence[tuple[ChunkHash, int]], tags: Tags = DEFAULT_TAGS) -> list[Pending | Declined]:
        """Room for each new store of a batch in chain order, evicting in policy order (the owner's own entries
        first where ``tags.tenant`` is past its share), and its write submitted; else why not. The batch is then
        reported to the policy deepest chunk first."""
        stamps = stamps_ns(len(items))
        with self._lock:
            self._sweep()
            out = [self._reserve_one(key, nbytes, stamp, tags) for (key, nbytes), stamp in zip(items, stamps)]
            for (key, _), job in zip(reversed(items), reversed(out)):
                if isinstance(job, Pending):
                    self._policy.on_insert(key)
                elif job is Declined.PRESENT and (entry := self._entries.get(key)) and entry.pending is None:
                    self._policy.on_access(key)  # (unless a later store of the batch evicted it meanwhile)
        return out

    def _reserve_one(self, key: ChunkHash, nbytes: int, stamp_ns: int, tags: Tags) -> Pending | Declined:
        entry = self._entries.get(key)
        if entry is not None:
            return Declined.PRESENT
        if self.closed:
            return Declined.CLOSED
        if nbytes > self.capacity:
            return Declined.TOO_LARGE
        if self.queued >= self._depth:
            return Declined.QUEUE_FULL
        owned = self.ledger.owned_by(tags.tenant)
        while self.ledger.over_share(tags.tenant, nbytes):
            if not self._evict(lambda k: owned(k) and self._evictable(k)):
                return Declined.OVER_QUOTA
        while self.used + nbytes > self.capacity:
            over = self.ledger.over_filter()  # tenants past their share give room first
            if not (over is not None and self._evict(lambda k: over(k) and self._evictable(k))) \
                    and not self._evict(self._evictable):
                return Declined.FULL_OF_PINNED
        job = Pending(key, nbytes, stamp_ns, tags)
        self._entries[key] = Entry(nbytes, job, tags)
        self.ledger.add(key, nbytes, tags)
        self.used += nbytes
        self.queued += 1
        self._submit_write(job)
        return job

    def _evictable(self, key: ChunkHash) -> bool:
        entry = self._entries[key]
        return entry.pins == 0 and entry.pending is None and not self.ledger.pinned(key)

    def _evict(self, evictable: Callable[[ChunkHash], bool]) -> bool:
        """Evict the policy's victim among ``evictable`` keys; False if there is none. Caller holds the lock."""
        victim = self._policy.victim(evictable)
        if victim is None:
            return False
        self._drop(victim, unlink=True)
        self._metrics.inc(EVICTIONS, tier=self._name)
        return True

    def _expire(self, key: ChunkHash) -> bool:
        """Drop ``key`` if it is visible and its retention time passed; True if it did. Caller holds the lock."""
        entry = self._entries.get(key)
        if entry is None or entry.pending is not None or not self.ledger.expired(key):
            return False
        self._drop(key, unlink=True)
        self._metrics.inc(EXPIRED, tier=self._name)
        return True

    def _sweep(self) -> None:
        """One step of the sweep of expired entries. Caller holds the lock."""
        for key in self.ledger.due():
            self._expire(key)

    def publish(self, job: Pending) -> bool:
        """The job's file is complete: make it visible. False if it was deleted meanwhile (remove the file)."""
        with self._lock:
            self.queued -= 1
            entry = self._entries.get(job.key)
            if entry is None or entry.pending is not job:
                return False
            entry.pending = None  # the policy has known it since its reservation
            return True

    def abandon(self, job: Pending) -> None:
        """The job's write failed or was cancelled: give its room back."""
        with self._lock:
            self.queued -= 1
            entry = self._entries.get(job.key)
            if entry is not None and entry.pending is job:
                self._drop(job.key, unlink=False)

    # -- removals ------------------------------------------------------------------------------------------
    def remove(self, keys: Sequence[ChunkHash]) -> None:
        """Delete: a visible entry's file is unlinked; a pending one is cancelled (its writer cleans up)."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    if entry.pending is not None:
                        entry.pending.cancelled = True
                    self._drop(key, unlink=entry.pending is None)

    def forget(self, key: ChunkHash, *, unlink: bool) -> None:
        """A visible entry whose file vanished (``unlink`` False) or cannot be read (True)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.pending is None:
                self._drop(key, unlink=unlink)

    def forget_all(self) -> None:
        """The directory is gone: drop every visible entry (pending writes fail or land on their own)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.pending is None]:
                self._drop(key, unlink=False)

    def load(self, found: Iterable[tuple[ChunkHash, int, Tags]]) -> None:
        """Add chunks found on disk (with the owners and expiries their names record), oldest first; evict the
        oldest if they exceed the capacity."""
        with self._lock:
            for key, nbytes, tags in found:
                if key not in self._entries:
                    self._entries[key] = Entry(nbytes, tags=tags)
                    self.ledger.add(key, nbytes, tags)
                    self.used += nbytes
                    self._policy.on_insert(key)
            while self.used > self.capacity and (victim := self._policy.victim(self._evictable)) is not None:
                self._drop(victim, unlink=True)
                self._metrics.inc(EVICTIONS, tier=self._name)

    def close(self) -> None:
        with self._lock:
            self.closed = True

    # -- cache control (kvtier/tiers/control.py) ----------------------------------------------------------
    def tags_of(self, keys: Sequence[ChunkHash]) -> list[Tags | None]:
        with self._lock:
            return [self.ledger.tags(key) for key in keys]

    def control_pin(self, keys: Sequence[ChunkHash]) -> int:
        """Pin the visible, unexpired ``keys`` against eviction (PinBudgetExceeded: none pinned)."""
        with self._lock:
            held = [k for k in keys if (e := self._entries.get(k)) is not None and e.pending is None
                    and not self._expire(k)]
            return self.ledger.pin(held)

    def pinned(self, keys: Sequence[ChunkHash]) -> list[bool]:
        with self._lock:
            return [self.ledger.pinned(key) for key in keys]

    def control_unpin(self, keys: Sequence[ChunkHash]) -> int:
        with self._lock:
            return self.ledger.unpin(keys)

    def clear(self, tenant: str | None) -> int:
        """Delete every entry (or ``tenant``'s), pending ones included: the number removed."""
        with self._lock:
            doomed = self.ledger.keys_of(tenant)
        self.remove(doomed)
        return len(doomed)

    def usage(self) -> TierUsage:
        with self._lock:
            return self.ledger.usage(len(self._entries), self.used)

    def gauges(self) -> list[tuple[str, dict[str, str], float]]:
        with self._lock:
            return list(self.ledger.gauges())

    def export_control(self, *, pins: bool = True, tags: bool = True) -> dict[str, object]:
        with self._lock:
            return self.ledger.export(pins=pins, tags=tags)

    def restore_control(self, data: dict[str, object]) -> None:
        with self._lock:
            self.ledger.restore(data)

    def retag(self, key: ChunkHash, tags: Tags, rename: Callable[[Tags], bool]) -> bool:
        """Give ``key``, held under a name without tags, the ``tags`` an older tier recorded elsewhere:
        ``rename(tags)`` moves its file to the name that records them (False: it could not). Nothing happens to
        a key not held, still being written, or already named with tags (its name is the newer record)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pending is not None or entry.tags != DEFAULT_TAGS or not rename(tags):
                return False
            entry.tags = tags
            self.ledger.add(key, entry.nbytes, tags)
            return True

    def _drop(self, key: ChunkHash, *, unlink: bool) -> None:
        entry = self._entries.pop(key)
        self.used -= entry.nbytes
        self.ledger.drop(key)
        self._policy.on_remove(key)  # pending entries too: the policy knows them from their reservation
        if unlink and not self.closed:
            self._submit_unlink(key, entry.tags)
        self._report(key)

    def _report(self, key: ChunkHash) -> None:
        if self.on_drop is not None and not self.closed:
            self.on_drop(key)
