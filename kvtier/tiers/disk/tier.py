"""Local-disk tier: one file per chunk under a directory, written in the background, read in parallel.

* **Index in RAM, truth on disk.** The index (index.py) is rebuilt at start from a listing of the
  directory (files.scan): leftovers of interrupted writes are removed, every complete file is an entry
  again, oldest first in the eviction order (by mtime).
* **Stores never wait on the disk.** ``put`` reserves room (evicting through the policy), copies the payload
  into a reused staging buffer and queues the write. Writer threads write a temp file, fsync it, rename it
  and fsync the directory; only then is the entry visible. At most ``write_queue_depth`` stores are queued:
  beyond that a store is dropped and counted (``kvtier_skipped_stores_total{reason="queue_full"}``). Each
  key always goes to the same writer thread, so its writes and removals happen in the order decided.
* **Reads overlap.** ``get`` reads its files on a thread pool, each into a reused page-aligned buffer, and
  hands out views of those buffers until its ``with`` block ends.
* **O_DIRECT** (on by default; docs/benchmarks/tiers.md) bypasses the page cache for both: the memory
  tier above is the cache, and a second copy in the page cache would only push other pages out. Filesystems
  that refuse it (tmpfs on older kernels) are detected on first use and served buffered.
* **Faults are misses.** ENOSPC, EIO or any failure while writing skips that store (temp file removed,
  counted); a failed or vanished read is a miss, and so is anything but a regular file where a chunk file
  should be (a FIFO, a symlink, ...): found without blocking, and removed. If the directory disappears the
  index is dropped; the next store recreates ``<root>/<codec>`` once ``<root>`` exists again and re-indexes
  whatever is there.
* **One process per directory.** The index and the capacity live in this process: two processes on one
  directory would each fill it to the capacity and evict each other's files unseen. The tier holds an
  exclusive flock on ``<root>/<codec>`` itself (so deleting a file cannot release it) and a second one is
  refused (ConfigError); processes that want one shared cache use a shared tier (Redis) instead.

Blobs here leave the process, so ``verifies = True``: KVCache seals them on store and checks every read.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from time import perf_counter

from kvtier.base.errors import ConfigError
from kvtier.base.keys import ChunkHash
from kvtier.base.metrics import declare_counter, declare_gauge, declare_histogram
from kvtier.codecs import Payload, get_codec
from kvtier.policy import make_policy
from kvtier.tiers.base import RemovalListener, TierContext, TierStats, stats_gauges
from kvtier.tiers.control import DEFAULT_TAGS, Feature, Tags
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.control import DiskControl
from kvtier.tiers.disk.files import (
    AlignedBufferPool,
    ChunkPaths,
    DiskIOError,
    lock_directory,
    read_into,
    remove,
    scan,
    touch,
    write_atomic,
)
from kvtier.tiers.disk.index import Declined, DiskIndex, Pending, stamps_ns
from kvtier.tiers.ledger import Ledger
from kvtier.tiers.metrics import SKIPPED_STORES, WRITTEN_BYTES

log = logging.getLogger(__name__)

IO_ERRORS = declare_counter("kvtier_disk_io_errors_total",
                            "Disk tier I/O failures, by step (write, fsync, read, ...) and errno.",
                            ("errno", "op", "tier"))
LEFTOVERS_REMOVED = declare_counter("kvtier_disk_leftovers_removed_total",
                                    "Files removed by the disk tier at start, by kind: temp, torn or stray.",
                                    ("kind", "tier"))
DIRECTORY_LOST = declare_counter("kvtier_disk_directory_lost_total",
                                 "Times the disk tier found its directory gone and dropped its index.", ("tier",))
REINDEX_SECONDS = declare_histogram("kvtier_disk_reindex_seconds",
                                    "Time the disk tier took to rebuild its index from the directory.", ("tier",))
WRITE_QUEUE = declare_gauge("kvtier_disk_write_queue", "Stores queued for the disk tier's background writer.",
                            ("tier",))

#: Free buffers kept for reuse by reads and by staged writes.
READ_POOL_RETAIN = 256 << 20
STAGING_POOL_RETAIN = 128 << 20


class DiskTier(DiskControl):
    """The Tier protocol over one directory of chunk files; ``Flushable`` (stores are written in the
    background), ``ChainOrdered``, a ``RemovalReporter`` and ``Listable`` (both count queued stores as held:
    see index.py), and ``Controlled`` (control.py: pins, owners and expiries survive a restart)."""

    verifies = True
    supports = frozenset(Feature)
    #: a get fans its reads out to the readers: fewer, larger windows spare a long load thread hand-offs
    #: (kvtier.core.pipeline)
    large_load_windows = True

    def __init__(self, config: DiskTierConfig, ctx: TierContext) -> None:
        assert config.path is not None  # DiskTierConfig requires it
        # with tensor parallelism each rank is its own process, and a directory belongs to one process
        root = config.path / f"rank{ctx.tp_rank}" if ctx.tp_size > 1 else config.path
        self.name = name = ctx.name
        self.codec = get_codec(config.codec)
        self.paths = ChunkPaths(root, self.codec.name)
        self.control_dir = self.paths.dir  #: where pins.json goes (control.py)
        self._metrics = ctx.metrics
        self._read_direct = self._write_direct = config.o_direct
        self._fsync = config.fsync
        self._lost = False  # the directory vanished; a writer takes it back on the next store
        self._recover_lock = threading.Lock()
        self._made: set[str] = set()  # subdirectories known to exist
        self._lock_fd: int | None = lock_directory(self.paths)
        self._staging = AlignedBufferPool(STAGING_POOL_RETAIN)
        self._read_pool = AlignedBufferPool(READ_POOL_RETAIN)
        self._writers = [ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{name}-writer")
                         for _ in range(config.write_threads)]
        self._readers = ThreadPoolExecutor(config.read_threads, thread_name_prefix=f"kvtier-{name}-read")
        self._index = DiskIndex(
            config.capacity_bytes, make_policy(config.policy), queue_depth=config.write_queue_depth,
            submit_write=lambda job: self._writer(job.key).submit(self._write, job),
            submit_unlink=lambda key, tags: self._writer(key).submit(self._unlink, self.paths.path(key, tags)),
            submit_touch=lambda key, tags, stamp: self._writer(key).submit(self._restamp, self.paths.path(key, tags),
                                                                           stamp),
            metrics=self._metrics, name=name, ledger=Ledger(config, config.capacity_bytes, ctx),
        )
        self._reindex()
        self._metrics.add_gauges(self._gauges)

    # -- the Tier protocol ---------------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkHash]) -> list[bool]:
        return self._index.contains(keys)

    @contextmanager
    def get(self, keys: Sequence[ChunkHash]) -> Iterator[list[memoryview | None]]:
        views: list[memoryview | None] = [None] * len(keys)
        pinned = self._index.pin(keys)
        reads = [(self.paths.path(key, entry.tags), entry.nbytes, stamp)
                 for (_, key, entry), stamp in zip(pinned, stamps_ns(len(pinned)))]
        bufs: list[mmap.mmap] = []
        try:
            if len(reads) == 1:
                results = [self._read(*reads[0])]
            else:
                results = list(self._readers.map(lambda read: self._read(*read), reads))
            for (i, key, _), result in zip(pinned, results):
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
            self._index.unpin(entry for _, _, entry in pinned)

    def put(self, items: Sequence[tuple[ChunkHash, Payload]]) -> list[bool]:
        """Queue the stores; True where the key is stored or now queued (visible once its file is complete)."""
        return self.put_tagged(items, DEFAULT_TAGS)

    def put_tagged(self, items: Sequence[tuple[ChunkHash, Payload]], tags: Tags) -> list[bool]:
        """``put``, the new entries owned and expiring as ``tags`` say (kvtier/tiers/control.py)."""
        jobs = self._index.reserve([(key, payload.nbytes) for key, payload in items], tags)
        done: list[bool] = []
        try:
            for job, (_, payload) in zip(jobs, items):
                done.append(self._stage(job, payload))
        finally:
            for job in jobs[len(done):]:  # a copy raised: the writers abandon the stores never staged
                if isinstance(job, Pending):
                    job.ready.set()
        return done

    def delete(self, keys: Sequence[ChunkHash]) -> None:
        self._index.remove(keys)

    def order_chain(self, keys: Sequence[ChunkHash]) -> None:
        """``ChainOrdered``: the policy orders the request's chunks deepest first, and their files' mtimes are
        stamped again in that order (writes and reads stamp each batch on its own), so a restart keeps it."""
        self._index.order_chain(keys)

    def stats(self) -> TierStats:
        return self._index.stats()

    def set_removal_listener(self, listener: RemovalListener | None) -> None:
        """See ``RemovalReporter``: called under the index lock, from any thread that changes the index."""
        self._index.on_drop = listener

    def list_keys(self) -> list[ChunkHash]:
        return self._index.keys()

    def flush(self) -> None:
        """Wait until every store queued so far is on disk (or failed)."""
        if not self._index.closed:
            wait([writer.submit(lambda: None) for writer in self._writers])

    def close(self) -> None:
        """Finish queued writes, stop the threads and release the directory."""
        if self._index.closed:
            return
        self.save_control()
        self._index.close()
        for writer in self._writers:
            writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- storing -------------------------------------------------------------------------------------------
    def _stage(self, job: Pending | Declined, payload: Payload) -> bool:
        if job is Declined.PRESENT:
            return True
        if isinstance(job, Declined):
            self._metrics.inc(SKIPPED_STORES, tier=self.name, reason=job.value)
            return False
        try:  # the writer waits for ``ready``; copying outside the index lock keeps lookups fast
            buf = self._staging.acquire(job.nbytes)
            payload.write_into(memoryview(buf)[: job.nbytes])
            job.buf = buf
        finally:
            job.ready.set()  # without buf on failure: the writer then abandons the store
        return True

    def _writer(self, key: ChunkHash) -> ThreadPoolExecutor:
        return self._writers[key[-1] % len(self._writers)]

    def _write(self, job: Pending) -> None:
        job.ready.wait()
        try:
            if job.buf is None or job.cancelled:
                self._index.abandon(job)
                return
            path = self.paths.path(job.key, job.tags)
            try:
                self._write_file(path, job.buf, job.nbytes, job.stamp_ns)
            except DiskIOError as exc:
                self._io_failed(exc.op, exc)
                self._metrics.inc(SKIPPED_STORES, tier=self.name, reason="io_error")
                self._index.abandon(job)
                return
            except Exception:  # a bug: this store is skipped; left pending, it would hold its room and queue slot
                log.exception("disk tier %s: writing chunk %s failed", self.name, job.key.hex())
                self._metrics.inc(SKIPPED_STORES, tier=self.name, reason="io_error")
                self._index.abandon(job)
                return
            if not self._index.publish(job):  # deleted while it was being written
                self._unlink(path)
            self._metrics.inc(WRITTEN_BYTES, job.nbytes, tier=self.name)
        finally:
            if job.buf is not None:
                self._staging.release(job.buf)
                job.buf = None

    def _write_file(self, path: str, buf: mmap.mmap, nbytes: int, stamp_ns: int | None = None) -> None:
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
            try:
                write_atomic(path, buf, nbytes, fsync=self._fsync, direct=self._write_direct, mtime_ns=stamp_ns)
            except DiskIOError as exc:
                if not (self._write_direct and exc.cause.errno == errno.EINVAL):
                    raise
                log.warning("disk tier %s: O_DIRECT writes refused (%s); writing buffered", self.name, exc)
                self._write_direct = False
                write_atomic(path, buf, nbytes, fsync=self._fsync, direct=False, mtime_ns=stamp_ns)
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

    def _restamp(self, path: str, stamp_ns: int) -> None:
        """Record a chunk's place in the order of last use; a file gone meanwhile (evicted, or its write
        skipped) has no place to keep."""
        try:
            touch(path, stamp_ns)
        except DiskIOError as exc:
            if exc.cause.errno != errno.ENOENT:
                self._io_failed("utime", exc)

    def _recover(self) -> None:
        """The directory vanished earlier: once ``<root>`` exists again, take it back and re-index it."""
        with self._recover_lock:
            if not self._lost:
                return  # another writer did it
            if not os.path.isdir(self.paths.root):
                raise DiskIOError("open", FileNotFoundError(errno.ENOENT, "directory is gone", self.paths.root))
            try:
                fd = lock_directory(self.paths)
            except (ConfigError, OSError) as exc:
                raise DiskIOError("lock", OSError(errno.EBUSY, str(exc))) from exc
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            self._lock_fd = fd
            self._made.clear()
            self._lost = False
            self._reindex()
        log.warning("disk tier %s: directory %s is back, re-indexed", self.name, self.paths.dir)

    # -- reading -------------------------------------------------------------------------------------------
    def _read(self, path: str, nbytes: int, stamp_ns: int) -> tuple[mmap.mmap, int] | DiskIOError:
        """Read a chunk file, then record the use in its mtime (what a restart orders the index by)."""
        buf = self._read_pool.acquire(nbytes)
        try:
            try:
                got = read_into(path, memoryview(buf), nbytes, direct=self._read_direct)
            except DiskIOError as exc:
                if not (self._read_direct and exc.cause.errno == errno.EINVAL):
                    raise
                log.warning("disk tier %s: O_DIRECT reads refused (%s); reading buffered", self.name, exc)
                self._read_direct = False
                got = read_into(path, memoryview(buf), nbytes, direct=False)
        except DiskIOError as exc:
            self._read_pool.release(buf)
            return exc
        try:
            touch(path, stamp_ns)
        except DiskIOError as exc:  # the chunk was read; only its place after a restart is lost
            self._io_failed("utime", exc)
        return buf, got

    def _read_failed(self, key: ChunkHash, exc: DiskIOError) -> None:
        self._io_failed("read", exc)
        vanished = exc.cause.errno == errno.ENOENT
        if not (vanished and self._check_directory()):
            self._index.forget(key, unlink=not vanished)  # an unreadable file goes too

    # -- start-up and loss ---------------------------------------------------------------------------------
    def _reindex(self) -> None:
        start = perf_counter()
        try:
            found, removed = scan(self.paths)
        except OSError as exc:
            log.warning("disk tier %s: cannot scan %s: %s", self.name, self.paths.dir, exc)
            return
        self._index.load(found)
        self.load_control()
        for kind, n in removed.items():
            if n:
                self._metrics.inc(LEFTOVERS_REMOVED, n, tier=self.name, kind=kind)
        elapsed = perf_counter() - start
        self._metrics.observe(REINDEX_SECONDS, elapsed, tier=self.name)
        log.info("disk tier %s: indexed %d chunks in %s in %.2f s, removed %s", self.name, len(found),
                 self.paths.dir, elapsed, removed)

    def _check_directory(self) -> bool:
        """True (and the index dropped) if the tier's directory is gone."""
        if os.path.isdir(self.paths.dir):
            return False
        with self._recover_lock:
            if self._lost:
                return True
            self._lost = True
        self._index.forget_all()
        self._metrics.inc(DIRECTORY_LOST, tier=self.name)
        log.error("disk tier %s: directory %s vanished; misses until it is back", self.name, self.paths.dir)
        return True

    def _io_failed(self, op: str, exc: DiskIOError) -> None:
        self._metrics.inc(IO_ERRORS, tier=self.name, op=op, errno=exc.errno_name)
        log.warning("disk tier %s: %s failed: %s", self.name, op, exc)

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        yield from stats_gauges(self)
        yield from self._index.gauges()
        yield WRITE_QUEUE.name, {"tier": self.name}, self._index.queued
