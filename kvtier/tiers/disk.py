"""Local-disk tier: one file per chunk under a directory, written in the background, read in parallel.

* **Index in RAM, truth on disk.** The index (key -> size, pins, LRU order) is rebuilt at start by listing the
  directory (disk_files.scan): leftovers of interrupted writes and files whose header disagrees with their
  size are removed, the rest are entries again, oldest first in the eviction order (by file mtime).
* **Stores never wait on the disk.** ``put`` reserves room (evicting through the policy), copies the payload
  into a staging buffer and queues the write; a single writer thread writes a temp file, fsyncs it, renames it
  and fsyncs the directory, and only then makes the entry visible. At most ``write_queue_depth`` writes are
  queued: a store beyond that is dropped and counted (``kvtier_skipped_stores_total{reason="queue_full"}``).
  Every change to the files (write, eviction, delete) goes through that one thread in the order the index
  made it, so a file on disk never contradicts the index for long and never in the wrong direction.
* **Reads overlap.** ``get`` reads its files on a thread pool, each into a reused page-aligned buffer
  (optionally O_DIRECT), and hands out views of those buffers until its ``with`` block ends.
* **Faults are misses.** ENOSPC, EIO or anything else failing in a write skips that store (temp file removed,
  counted); a failed or vanished read is a miss. If the directory disappears the index is dropped; the next
  store recreates ``<root>/<codec>`` once ``<root>`` exists again and re-indexes whatever is there.
* **One process per directory.** The index lives in this process, so two processes on one directory would
  each enforce the capacity alone and evict each other's files unseen. The tier takes an exclusive flock on
  ``<root>/<codec>/.lock`` and refuses (ConfigError) a directory another process holds; processes that want
  one shared cache use a shared tier (Redis) instead.

Blobs here leave the process, so ``verifies = True``: KVCache seals them on store and checks every read.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

from kvtier.codecs import Payload, get_codec
from kvtier.errors import ConfigError
from kvtier.keys import ChunkHash
from kvtier.metrics import Metrics
from kvtier.policy import EvictionPolicy, make_policy
from kvtier.tiers.base import TierConfig, TierContext, TierStats, register_tier
from kvtier.tiers.disk_files import (
    BufferPool,
    DiskIOError,
    Layout,
    lock_directory,
    read_into,
    remove,
    round_up,
    scan,
    write_atomic,
)

log = logging.getLogger(__name__)

#: Free buffers kept for reuse by reads and by staged writes.
READ_POOL_RETAIN = 256 << 20
STAGING_POOL_RETAIN = 128 << 20


class _Write:
    """One queued write. ``ready`` is set once ``buf`` holds the payload (or the copy failed: ``buf`` None)."""

    __slots__ = ("buf", "cancelled", "key", "nbytes", "ready")

    def __init__(self, key: ChunkHash, nbytes: int) -> None:
        self.key, self.nbytes, self.buf, self.cancelled = key, nbytes, None, False
        self.ready = threading.Event()


class _Entry:
    __slots__ = ("nbytes", "pins", "write")

    def __init__(self, nbytes: int, write: _Write | None = None) -> None:
        self.nbytes, self.pins, self.write = nbytes, 0, write  # write is set while the file is not yet complete


class DiskTier:
    verifies = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        codec: str = "raw",
        policy: EvictionPolicy | None = None,
        metrics: Metrics | None = None,
        name: str = "disk",
        write_queue_depth: int = 16,
        read_threads: int = 4,
        o_direct: bool = False,
        fsync: bool = True,
    ) -> None:
        if write_queue_depth < 1 or read_threads < 1:
            raise ConfigError("write_queue_depth and read_threads must be at least 1")
        self.name = name
        self.codec = get_codec(codec)
        self.layout = Layout(path, self.codec.name)
        self.capacity = capacity_bytes
        self._policy = policy if policy is not None else make_policy("lru")
        self._metrics = metrics if metrics is not None else Metrics()
        self._depth, self._direct, self._fsync = write_queue_depth, o_direct, fsync
        self._lock = threading.Lock()
        self._entries: dict[ChunkHash, _Entry] = {}
        self._used = 0
        self._queued = 0  # writes queued or running
        self._lost = False  # the directory vanished; the writer recovers on the next store
        self._closed = False
        self._made: set[str] = set()  # subdirectories known to exist (writer thread only)
        self._lock_fd: int | None = lock_directory(self.layout)
        self._staging = BufferPool(STAGING_POOL_RETAIN)
        self._read_pool = BufferPool(READ_POOL_RETAIN)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{name}-writer")
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix=f"kvtier-{name}-read")
        self._reindex()
        self._metrics.add_gauges(self._gauges)

    # -- the Tier protocol ---------------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkHash]) -> list[bool]:
        entries = self._entries
        with self._lock:
            return [(e := entries.get(key)) is not None and e.write is None for key in keys]

    @contextmanager
    def get(self, keys: Sequence[ChunkHash]) -> Iterator[list[memoryview | None]]:
        views: list[memoryview | None] = [None] * len(keys)
        todo: list[tuple[int, ChunkHash, _Entry]] = []
        with self._lock:
            if not self._closed:
                for i, key in enumerate(keys):
                    entry = self._entries.get(key)
                    if entry is not None and entry.write is None:
                        entry.pins += 1
                        self._policy.on_access(key)
                        todo.append((i, key, entry))
        bufs = []
        try:
            if len(todo) == 1:
                results = [self._read(todo[0][1], todo[0][2].nbytes)]
            else:
                results = list(self._readers.map(lambda t: self._read(t[1], t[2].nbytes), todo))
            for (i, key, _), result in zip(todo, results):
                if isinstance(result, DiskIOError):
                    self._read_failed(key, result)
                    continue
                buf, n = result
                bufs.append(buf)
                views[i] = memoryview(buf)[:n]
            yield views
        finally:
            for buf in bufs:
                self._read_pool.release(buf)
            with self._lock:
                for _, _, entry in todo:
                    entry.pins -= 1

    def put(self, items: Sequence[tuple[ChunkHash, Payload]]) -> list[bool]:
        """Queue the stores; True where the key is present or now queued (visible once written)."""
        return [self._put_one(key, payload) for key, payload in items]

    def delete(self, keys: Sequence[ChunkHash]) -> None:
        with self._lock:
            for key in keys:
                entry = self._entries.pop(key, None)
                if entry is None:
                    continue
                self._used -= entry.nbytes
                if entry.write is not None:
                    entry.write.cancelled = True  # the writer drops it, or removes the file it just made
                else:
                    self._policy.on_remove(key)
                    self._submit_unlink(key)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self._used, self.capacity, len(self._entries))

    def flush(self) -> None:
        """Wait until every store queued so far is on disk (or failed)."""
        if not self._closed:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish queued writes, stop the threads and release the directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- storing -------------------------------------------------------------------------------------------
    def _put_one(self, key: ChunkHash, payload: Payload) -> bool:
        nbytes = payload.nbytes
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                if entry.write is None:
                    self._policy.on_access(key)
                return True
            reason = self._reserve(nbytes)
            if reason is not None:
                self._metrics.inc("kvtier_skipped_stores_total", tier=self.name, reason=reason)
                return False
            job = _Write(key, nbytes)
            self._entries[key] = _Entry(nbytes, job)
            self._used += nbytes
            self._queued += 1
            self._writer.submit(self._write, job)  # under the lock: the writer sees file changes in index order
        try:
            buf = self._staging.acquire(nbytes)
            payload.write_into(memoryview(buf)[:nbytes])
            job.buf = buf
        finally:
            job.ready.set()  # without buf on failure: the writer then drops the entry
        return True

    def _reserve(self, nbytes: int) -> str | None:
        """Make room for ``nbytes`` (evicting in policy order); the reason it cannot, or None. Holds the lock."""
        if self._closed:
            return "closed"
        if nbytes > self.capacity:
            return "too_large"
        if self._queued >= self._depth:
            return "queue_full"
        while self._used + nbytes > self.capacity:
            victim = self._policy.victim(lambda k: self._entries[k].pins == 0)
            if victim is None:
                return "full_of_pinned"
            self._used -= self._entries.pop(victim).nbytes
            self._policy.on_remove(victim)
            self._submit_unlink(victim)
            self._metrics.inc("kvtier_evictions_total", tier=self.name)
        return None

    def _submit_unlink(self, key: ChunkHash) -> None:
        if not self._closed:
            self._writer.submit(self._unlink, self.layout.path(key))

    # -- the writer thread ---------------------------------------------------------------------------------
    def _write(self, job: _Write) -> None:
        job.ready.wait()
        try:
            if job.buf is None or job.cancelled:
                self._unreserve(job)
                return
            path = self.layout.path(job.key)
            try:
                self._write_file(path, memoryview(job.buf)[: job.nbytes])
            except DiskIOError as exc:
                self._io_failed(exc.op, exc)
                self._metrics.inc("kvtier_skipped_stores_total", tier=self.name, reason="io_error")
                self._unreserve(job)
                return
            with self._lock:
                entry = self._entries.get(job.key)
                published = entry is not None and entry.write is job
                if published:
                    entry.write = None
                    self._policy.on_insert(job.key)
                self._queued -= 1
            if not published:  # deleted while it was being written
                self._unlink(path)
            self._metrics.inc("kvtier_written_bytes_total", job.nbytes, tier=self.name)
        finally:
            if job.buf is not None:
                self._staging.release(job.buf)
                job.buf = None

    def _unreserve(self, job: _Write) -> None:
        with self._lock:
            entry = self._entries.get(job.key)
            if entry is not None and entry.write is job:
                del self._entries[job.key]
                self._used -= entry.nbytes
            self._queued -= 1

    def _write_file(self, path: str, data: memoryview) -> None:
        if self._lost:
            self._recover()
        sub = os.path.dirname(path)
        if sub not in self._made:
            try:
                os.mkdir(sub)
            except FileExistsError:
                pass
            except OSError as exc:
                self._check_directory()
                raise DiskIOError("mkdir", exc) from exc
            self._made.add(sub)
        try:
            write_atomic(path, data, fsync=self._fsync)
        except DiskIOError as exc:
            if exc.cause.errno == errno.ENOENT:
                self._made.discard(sub)
                self._check_directory()
            raise

    def _unlink(self, path: str) -> None:
        try:
            remove(path)
        except DiskIOError as exc:
            self._io_failed("unlink", exc)

    def _recover(self) -> None:
        """The directory vanished earlier: once ``<root>`` exists again, take it back and re-index it."""
        if not os.path.isdir(self.layout.root):
            raise DiskIOError("open", FileNotFoundError(errno.ENOENT, "directory is gone", self.layout.root))
        try:
            fd = lock_directory(self.layout)
        except ConfigError as exc:
            raise DiskIOError("lock", OSError(errno.EBUSY, str(exc))) from exc
        except OSError as exc:
            raise DiskIOError("lock", exc) from exc
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd = fd
        self._made.clear()
        with self._lock:
            self._lost = False
        self._reindex()
        log.warning("disk tier %s: directory %s is back, re-indexed", self.name, self.layout.dir)

    # -- reading -------------------------------------------------------------------------------------------
    def _read(self, key: ChunkHash, nbytes: int) -> tuple[object, int] | DiskIOError:
        buf = self._read_pool.acquire(round_up(nbytes))
        path = self.layout.path(key)
        try:
            try:
                return buf, read_into(path, memoryview(buf), nbytes, direct=self._direct)
            except DiskIOError as exc:
                if not (self._direct and exc.op == "open" and exc.cause.errno == errno.EINVAL):
                    raise
                log.warning("disk tier %s: O_DIRECT refused by the filesystem; reading buffered", self.name)
                self._direct = False
                return buf, read_into(path, memoryview(buf), nbytes, direct=False)
        except DiskIOError as exc:
            self._read_pool.release(buf)
            return exc

    def _read_failed(self, key: ChunkHash, exc: DiskIOError) -> None:
        self._io_failed("read", exc)
        if exc.cause.errno == errno.ENOENT and self._check_directory():
            return
        with self._lock:  # vanished or unreadable: forget it (an unreadable file goes too)
            entry = self._entries.get(key)
            if entry is not None and entry.write is None:
                del self._entries[key]
                self._used -= entry.nbytes
                self._policy.on_remove(key)
                if exc.cause.errno != errno.ENOENT:
                    self._submit_unlink(key)

    # -- start-up and loss ---------------------------------------------------------------------------------
    def _reindex(self) -> None:
        """Add every complete file to the index, oldest first; evict down to the capacity if it shrank."""
        start = perf_counter()
        try:
            found, removed = scan(self.layout, self.codec.codec_id)
        except (OSError, DiskIOError) as exc:
            log.warning("disk tier %s: cannot scan %s: %s", self.name, self.layout.dir, exc)
            return
        victims = []
        with self._lock:
            for f in found:
                if f.key not in self._entries:
                    self._entries[f.key] = _Entry(f.nbytes)
                    self._used += f.nbytes
                    self._policy.on_insert(f.key)
            while self._used > self.capacity and (victim := self._policy.victim(lambda k: True)) is not None:
                self._used -= self._entries.pop(victim).nbytes
                self._policy.on_remove(victim)
                victims.append(victim)
        for victim in victims:
            self._unlink(self.layout.path(victim))
        for kind, n in removed.items():
            if n:
                self._metrics.inc("kvtier_disk_leftovers_removed_total", n, tier=self.name, kind=kind)
        self._metrics.observe("kvtier_disk_reindex_seconds", perf_counter() - start, tier=self.name)
        log.info("disk tier %s: indexed %d chunks in %s (%.2f s), removed %s, evicted %d", self.name, len(found),
                 self.layout.dir, perf_counter() - start, removed, len(victims))

    def _check_directory(self) -> bool:
        """True (and the index dropped) if the tier's directory is gone."""
        if os.path.isdir(self.layout.dir):
            return False
        with self._lock:
            if self._lost:
                return True
            self._lost = True
            for key, entry in list(self._entries.items()):
                if entry.write is None:  # queued writes fail or land on their own
                    del self._entries[key]
                    self._used -= entry.nbytes
                    self._policy.on_remove(key)
        self._metrics.inc("kvtier_disk_directory_lost_total", tier=self.name)
        log.error("disk tier %s: directory %s vanished; serving misses until it is back", self.name, self.layout.dir)
        return True

    def _io_failed(self, op: str, exc: DiskIOError) -> None:
        self._metrics.inc("kvtier_disk_io_errors_total", tier=self.name, op=op, errno=exc.errno_name)
        log.warning("disk tier %s: %s failed: %s", self.name, op, exc)

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        stats = self.stats()
        labels = {"tier": self.name}
        yield "kvtier_tier_used_bytes", labels, stats.used_bytes
        yield "kvtier_tier_capacity_bytes", labels, stats.capacity_bytes
        yield "kvtier_tier_entries", labels, stats.entries
        yield "kvtier_disk_write_queue", labels, self._queued


@register_tier
@dataclass(frozen=True)
class DiskTierConfig(TierConfig):
    """``path``: root directory (chunks go to ``<path>/<codec>/``, one process per directory);
    ``capacity_bytes``: hard limit on stored blob bytes; ``policy``: eviction policy; ``write_queue_depth``:
    stores queued for the background writer before new ones are dropped; ``read_threads``: parallel file
    reads; ``o_direct``: bypass the page cache on reads; ``fsync``: make each chunk durable before it counts
    (off: a machine crash may lose recent chunks, which the checksum then turns into misses)."""

    kind = "disk"
    path: Path | None = None
    capacity_bytes: int = 64 << 30
    policy: str = "lru"
    write_queue_depth: int = 16
    read_threads: int = 4
    o_direct: bool = False
    fsync: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path is None:
            raise ConfigError("tiers[disk]: path is required (YAML path: ..., or KVTIER_DISK_PATH)")
        make_policy(self.policy)

    def build(self, ctx: TierContext) -> DiskTier:
        assert self.path is not None
        return DiskTier(
            self.path, self.capacity_bytes, codec=self.codec, policy=make_policy(self.policy), metrics=ctx.metrics,
            name=ctx.name, write_queue_depth=self.write_queue_depth, read_threads=self.read_threads,
            o_direct=self.o_direct, fsync=self.fsync,
        )
