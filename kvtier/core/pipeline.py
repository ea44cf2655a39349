"""Moving chunk bytes between tiers and the engine in overlapping windows, on a small thread pool.

The pipeline is handed whole jobs (jobs.py): a ``LoadJob`` or a ``StoreJob``, tuned by a ``PipelineTuning``. It
answers with what happened (``LoadResult``, ``PutResult``: chunks that failed verification, tiers that failed)
and leaves counting, deleting and events to the chain (chain.py); the one thing it hands up while it works is
each window's chunks found below the first tier, to its ``Promoter``, while their memory is still valid.

Retrieve: the chunks a tier holds are cut into windows of ``window_bytes`` of KV, larger for a long prefix from
a tier with ``large_load_windows`` (up to ``max_window_bytes``, see ``Pipeline.windows``), and no larger than one
get of a tier with ``BoundedGets`` holds (kvtier/core/bounded.py; stores too); each window is one
task that reads its blobs (``tier.get``, pinned until the task ends), then takes one of ``decoders`` decode
slots, verifies and decodes each chunk, and writes it to the sink. ``read_ahead`` more tasks than slots are in
flight, so the next windows are being read from a slow tier while the cores decode, and windows decode in
parallel (the codecs release the GIL). Correctness does not depend on the overlap:

* a chunk reaches the sink only after ``decode_blob`` verified it (tokens, shape and dtype always, checksum where
  sealed); a raw chunk decoded into memory the sink lends is checksummed while it is copied there (one read of
  its bytes, not two), so that memory may hold the bytes of a chunk that then failed, which never counts as
  arrived (the sink's memory past the returned prefix is not valid: ``KVCache.retrieve``);
* pins are released by the task's own ``with tier.get(...)`` block, on every path, errors included;
* a chunk that fails ends the prefix there: windows wholly after the first failure are not read (the
  chunks of a window already read are all still verified, so corrupt ones are found and reported), and the
  caller keeps only the leading run of loaded chunks (the sink may hold later chunks; only the returned
  number of tokens is valid, as ``KVCache.retrieve`` documents).

Chunks are decoded straight into the sink's memory where it lends it (``destination``, as ``TensorSink`` does
for a CPU tensor): no chunk-sized temporary and no second pass over the bytes. Otherwise a codec that can
decode into a buffer (``decode_into``) decodes into its worker's reused scratch chunk, which is then handed to
the sink's ``write`` (a fresh chunk-sized tensor per chunk would cost a page fault per page). Sinks receive
writes from worker threads; one at a time unless the sink sets ``concurrent_writes = True`` (disjoint token
ranges may then be written in parallel). A sink that goes on reading a chunk after ``write`` returns (the vLLM
connector's DMA to a GPU straight out of the memory tier's pinned buffer) has ``settle`` called before the
scratch is decoded into again and before a window's pins are released.

Chunks that are copies and nothing else -- raw chunks from a tier in this process's memory -- are one window
run in the calling thread: nothing overlaps, torch spreads each copy over the cores itself, and the chunks are
all checked first and then copied in one call, with no Python work between the copies.

Store: chunks are encoded window by window on the pool while the calling thread hands finished windows to
``tier.put`` in order, so encoding window i+1 overlaps writing window i, and windows encode in parallel. A
codec that only copies (raw: the tier's ``put`` does the one copy) is put window by window from the
calling thread, into a tier in this process's memory as one put, which the memory tier writes with its
copies in one call, and into a ``BoundedGets`` tier in puts as large as one of its gets (the Mooncake tier
writes each slice of a put into its buffer while the last one moves).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from kvtier.base.errors import BlobError, KVTierError
from kvtier.base.layout import KVSpec
from kvtier.base.metrics import Metrics
from kvtier.codecs.base import CopiesOnly, DecodesInto, copy_tensors
from kvtier.codecs.blob import decode_blob, encode_blob
from kvtier.core.bounded import blob_bytes, per_get
from kvtier.core.jobs import (
    ConcurrentSink,
    Corrupt,
    Entry,
    Failure,
    LendingSink,
    LoadJob,
    LoadResult,
    PipelineTuning,
    PutResult,
    SettlingSink,
    StoreJob,
    source_device,
)
from kvtier.tiers import LargeLoadWindows, Tier
from kvtier.tiers.control import Tags, put_tagged
from kvtier.tiers.metrics import READ_BYTES


class Pipeline:
    """The thread pool and the windowing shared by a KVCache's retrieve and store. Thread-safe."""

    def __init__(self, spec: KVSpec | None, chunk_size: int, metrics: Metrics,
                 tuning: PipelineTuning | None = None) -> None:
        """``spec``: the model's attention KV (None for a model without attention: nothing to move)."""
        self.tuning = tuning = tuning if tuning is not None else PipelineTuning()
        chunk_bytes = max(spec.bytes_per_token * chunk_size if spec is not None else 0, 1)
        self.per_window = max(1, tuning.window_bytes // chunk_bytes)  # chunks per window, at least
        self.max_per_window = max(self.per_window, tuning.max_window_bytes // chunk_bytes)
        self.per_device_window = max(1, tuning.device_window_bytes // chunk_bytes)
        self.spec, self.chunk_size = spec, chunk_size
        self.chunk_bytes = chunk_bytes  #: raw KV bytes of one chunk (at least 1)
        self.blob_bytes = blob_bytes(spec, chunk_size)  #: the most one chunk's blob takes in a bounded get
        self.metrics = metrics
        self._chunk = (spec.chunk_shape(chunk_size), spec.dtype) if spec is not None else None
        self._scratch = threading.local()  # per worker: one decoded chunk for sinks without a destination
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._decoding = threading.Semaphore(tuning.decoders)  # decode slots, shared by concurrent retrieves

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.tuning.workers, thread_name_prefix="kvtier-io")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def windows(self, idx: Sequence[int], *, grow: bool, most: int | None = None) -> Iterator[Sequence[int]]:
        """``idx`` cut in order into windows of equal size: ``per_window`` chunks, or with ``grow`` more (up to
        ``max_per_window``) while every worker still gets ``windows_per_worker`` windows; never more than ``most``
        (what one get of a ``BoundedGets`` tier holds: ``per_get``).

        Loads from a tier with ``large_load_windows`` grow their windows: each window costs thread hand-offs (a
        task, a decode slot, a ``get`` whose reads fan out to a disk tier's readers). Network tiers, whose ``get``
        must arrive whole before its chunks decode, keep ``per_window``; so do stores, which put windows in order.
        Windows stay equal in size: ones that shrink towards the end of the prefix leave workers idle."""
        per = self.per_window
        if grow:
            workers = self.tuning.windows_per_worker * self.tuning.workers
            per = min(self.max_per_window, max(per, len(idx) // workers))
        if most is not None:
            per = max(1, min(per, most))
        for start in range(0, len(idx), per):
            yield idx[start : start + per]

    # -- retrieve ------------------------------------------------------------------------------------------
    def load(self, job: LoadJob) -> LoadResult:
        """Load every located chunk of ``job`` into its sink. Never raises for tier failures or corrupt chunks
        (they are in the result); an error of the sink's reaches the caller once every window has ended."""
        state = _LoadState(job, self.chunk_size, self._chunk[0] if self._chunk is not None else None)
        tasks = []
        for t, tier in enumerate(job.tiers):
            idx = [i for i, w in enumerate(job.where) if w == t]
            if idx and _copies_only(tier):  # one window: its chunks are all checked, then copied back to back
                tasks.append((t, idx))
                continue
            grow = isinstance(tier, LargeLoadWindows) and tier.large_load_windows
            tasks.extend((t, window) for window in self.windows(idx, grow=grow, most=self.per_get(tier)))
        # A single window, and copy-only windows, run in the calling thread: there is nothing to overlap (torch
        # spreads a copy over the cores itself), and a thread hop costs more than such a window's Python work.
        pooled, inline = [], tasks
        if len(tasks) > 1:
            pooled = [task for task in tasks if not _copies_only(job.tiers[task[0]])]
            inline = [task for task in tasks if _copies_only(job.tiers[task[0]])]
        futures = []
        if pooled:
            pool = self._executor()
            # Workers write into the caller's tensors: under inference mode those are inference tensors, which
            # only code in inference mode may update, and the mode is per thread.
            mode = torch.is_inference_mode_enabled()
            futures = [pool.submit(self._load_window_in_mode, mode, state, t, window) for t, window in pooled]
        try:
            for t, window in inline:
                self._load_window(state, t, window)
        finally:
            wait(futures)  # all of them, even after one raised: none may touch the sink after we return
        for future in futures:
            future.result()  # an engine's sink error reaches the caller, as it did without the pipeline
        return LoadResult(state.ok, state.corrupt, state.failures)

    def per_get(self, tier: Tier) -> int | None:
        """How many chunks one get (or put) of ``tier`` holds; None: any number."""
        return per_get(tier, self.blob_bytes)

    def _load_window_in_mode(self, inference_mode: bool, state: _LoadState, t: int, window: Sequence[int]) -> None:
        with torch.inference_mode(inference_mode):
            self._load_window(state, t, window)

    def _load_window(self, state: _LoadState, t: int, window: Sequence[int]) -> None:
        """Read, verify and decode the window's chunks (of tier ``t``) into the sink. Copy-only chunks are all
        checked first and then copied in one call: Python work between large copies slows them."""
        if window[0] > state.first_bad:
            return  # the prefix already ends before this window: reading it would be wasted
        tier = state.job.tiers[t]
        try:
            with tier.get([state.job.keys[i] for i in window]) as blobs, self._decoding:
                try:
                    if _copies_only(tier):
                        self._copy_window(state, t, window, blobs)
                    else:
                        self._decode_window(state, t, window, blobs)
                finally:
                    state.settle()  # the sink is done reading the blobs before their pins are released
        except KVTierError as exc:
            for i in window:
                state.fail(i)
            state.failed(Failure(tier, "get", exc))

    def _verified(self, state: _LoadState, t: int, i: int, blob: memoryview | None,
                  out: torch.Tensor | None, lent: bool = False) -> torch.Tensor | None:
        """Chunk ``i`` decoded out of ``blob`` (into ``out`` where given) once it verified; None for a miss.
        ``lent``: ``out`` is the sink's own memory, which may then hold a raw chunk that failed its checksum
        (verified while it is copied: ``decode_blob``'s ``write_early``)."""
        if blob is None:
            state.fail(i)
            return None
        tier, size = state.job.tiers[t], self.chunk_size
        try:
            return decode_blob(blob, state.job.keys[i], state.job.token_ids[i * size : (i + 1) * size],
                               codec=tier.codec, verify=tier.verifies, out=out, expect=self._chunk,
                               write_early=lent)
        except BlobError as exc:
            state.fail(i)
            state.found_corrupt(Corrupt(t, state.job.keys[i], exc))
            return None

    def _copy_window(self, state: _LoadState, t: int, window: Sequence[int], blobs) -> None:
        """Every chunk checked, then all copied into the sink's memory in one call (or written one by one)."""
        size = self.chunk_size
        checked = []
        for i, blob in zip(window, blobs):
            chunk = self._verified(state, t, i, blob, None)
            if chunk is not None:
                checked.append((i, chunk, blob.nbytes))
        dests = [state.destination(i * size, (i + 1) * size) for i, _, _ in checked]
        copy_tensors([(d, c) for d, (_, c, _) in zip(dests, checked) if d is not None])
        for dest, (i, chunk, nbytes) in zip(dests, checked):
            state.arrived(i, chunk, written=dest is not None)
        self._read(state, t, [(i, chunk) for i, chunk, _ in checked], sum(n for _, _, n in checked))

    def _decode_window(self, state: _LoadState, t: int, window: Sequence[int], blobs) -> None:
        """Each chunk decoded into the sink's memory, or into this worker's scratch chunk and then written."""
        size, promote, nbytes = self.chunk_size, [], 0
        for i, blob in zip(window, blobs):
            if blob is None:
                state.fail(i)
                continue
            dest = state.destination(i * size, (i + 1) * size)
            scratch = self._buffer(state.job.tiers[t]) if dest is None else None
            chunk = self._verified(state, t, i, blob, dest if dest is not None else scratch, lent=dest is not None)
            if chunk is None:
                continue
            state.arrived(i, chunk, written=dest is not None)
            promote.append((i, chunk))
            nbytes += blob.nbytes
            if scratch is not None:  # the scratch is decoded into again next: done with this chunk first
                self._read(state, t, promote, nbytes)
                promote, nbytes = [], 0
                state.settle()
        self._read(state, t, promote, nbytes)

    def _read(self, state: _LoadState, t: int, chunks: Sequence[tuple[int, torch.Tensor]], nbytes: int) -> None:
        """``chunks`` of tier ``t`` arrived: count their bytes, and promote them where they came from below."""
        if not chunks:
            return
        self.metrics.inc(READ_BYTES, nbytes, tier=state.job.tiers[t].name)
        job, size = state.job, self.chunk_size
        if t > 0 and job.promoter is not None:
            job.promoter.promote(t, [Entry(job.keys[i], job.token_ids[i * size : (i + 1) * size], chunk)
                                     for i, chunk in chunks])

    def _buffer(self, tier: Tier) -> torch.Tensor | None:
        """This worker's scratch chunk, for a codec that decodes into memory; None for one whose ``decode``
        costs nothing (raw views the blob, and the sink's ``write`` is then the only copy)."""
        if self._chunk is None or not isinstance(tier.codec, DecodesInto):
            return None
        buf = getattr(self._scratch, "chunk", None)
        if buf is None:
            shape, dtype = self._chunk
            buf = self._scratch.chunk = torch.empty(shape, dtype=dtype)
        return buf

    # -- store ---------------------------------------------------------------------------------------------
    def encode_and_put(self, tier: Tier, missing: Sequence[int], job: StoreJob) -> PutResult:
        """Encode the ``missing`` chunks of ``job`` for ``tier`` window by window on the pool, putting each window
        in order as soon as it is encoded. A KVTierError (an encode or a put that failed) ends the store there,
        after the encodes in flight have finished (so the source is no longer read when this returns)."""
        size = self.chunk_size

        def encode(window: Sequence[int]) -> list:
            return [(job.keys[i], encode_blob(job.keys[i], job.token_ids[i * size : (i + 1) * size], tier.codec,
                                              job.source.chunk(i * size, (i + 1) * size), seal=tier.verifies))
                    for i in window]

        # Copy-only chunks into a tier in this process's memory are one put: the tier writes them all at once.
        # From a source on a GPU, windows bound the GPU memory the gathered chunks take, and the pool gathers the
        # next window while this thread waits for the copies of the last: the GPU's copy engine is kept busy.
        on_gpu = source_device(job.source).type != "cpu"
        ahead = self.tuning.store_ahead
        if on_gpu and _copies_only(tier):
            per, ahead = self.per_device_window, 1
            windows = [missing[start : start + per] for start in range(0, len(missing), per)]
        elif _copies_only(tier):
            windows = [missing]
        elif _codec_copies_only(tier) and (most := self.per_get(tier)) is not None:
            # a bounded tier cuts its puts into slices itself and writes the next while the last one moves (the
            # Mooncake tier): windows as large as one of its gets, so that overlap spans them
            windows = [missing[start : start + most] for start in range(0, len(missing), most)]
        else:
            windows = list(self.windows(missing, grow=False, most=self.per_get(tier)))
        done: list[int] = []
        if len(windows) == 1 or (_codec_copies_only(tier) and not on_gpu):  # nothing to overlap
            try:
                for window in windows:
                    done.extend(i for i, s in zip(window, put_tagged(tier, encode(window), job.tags)) if s)
            except KVTierError as exc:
                return PutResult(done, Failure(tier, "put", exc))
            return PutResult(done)
        return self._put_ahead(tier, windows, encode, ahead, job.tags)

    def _put_ahead(self, tier: Tier, windows: Sequence[Sequence[int]], encode, ahead: int, tags: Tags) -> PutResult:
        """Windows encoded on the pool, up to ``ahead`` beyond the one this thread puts, in order."""
        pool = self._executor()
        pending: deque[tuple[Sequence[int], Future]] = deque()
        done: list[int] = []

        def put_oldest() -> None:
            window, future = pending.popleft()
            done.extend(i for i, s in zip(window, put_tagged(tier, future.result(), tags)) if s)

        try:
            for window in windows:
                pending.append((window, pool.submit(encode, window)))
                if len(pending) > ahead:
                    put_oldest()
            while pending:
                put_oldest()
        except KVTierError as exc:
            return PutResult(done, Failure(tier, "put", exc))
        finally:
            for _, future in pending:  # something failed: let the encodes in flight end before the source may go
                future.exception()
        return PutResult(done)


def _codec_copies_only(tier: Tier) -> bool:
    return isinstance(tier.codec, CopiesOnly) and tier.codec.copies_only


def _copies_only(tier: Tier) -> bool:
    """A tier in this process's memory (it does not verify: its bytes never leave the process) with a codec that
    only copies (raw decodes to a view of the blob): loading from it is the sink's copy and nothing else."""
    return not tier.verifies and _codec_copies_only(tier)


class _LoadState:
    """What the windows of one load share: which chunks arrived, the first failure, what went wrong, the sink's
    lock."""

    def __init__(self, job: LoadJob, chunk_size: int, chunk_shape: tuple[int, ...] | None) -> None:
        self.job = job
        self.chunk_size = chunk_size
        self.ok = [False] * len(job.keys)
        self.first_bad = len(job.keys)
        self.corrupt: list[Corrupt] = []
        self.failures: list[Failure] = []
        self._shape = chunk_shape
        sink = job.sink
        self._lend = sink if isinstance(sink, LendingSink) else None
        self._settle = sink if isinstance(sink, SettlingSink) else None
        concurrent = isinstance(sink, ConcurrentSink) and sink.concurrent_writes
        self._lock = threading.Lock()
        self._write_lock = contextlib.nullcontext() if concurrent else threading.Lock()

    def fail(self, i: int) -> None:
        with self._lock:
            self.first_bad = min(self.first_bad, i)

    def found_corrupt(self, corrupt: Corrupt) -> None:
        with self._lock:
            self.corrupt.append(corrupt)

    def failed(self, failure: Failure) -> None:
        with self._lock:
            self.failures.append(failure)

    def destination(self, start: int, end: int) -> torch.Tensor | None:
        """The sink's memory for tokens ``[start, end)``, if it lends it. One of the wrong shape or device is the
        sink's error (ValueError, to the caller), never taken for a corrupt chunk."""
        dest = self._lend.destination(start, end) if self._lend is not None else None
        if dest is not None and (tuple(dest.shape) != self._shape or dest.device.type != "cpu"):
            raise ValueError(f"sink lent a {tuple(dest.shape)} tensor on {dest.device} for tokens [{start}, {end}), "
                             f"not {self._shape} on the CPU")
        return dest

    def settle(self) -> None:
        """Let the sink finish reading every chunk written so far (a no-op for sinks that copy in ``write``)."""
        if self._settle is not None:
            with self._write_lock:
                self._settle.settle()

    def arrived(self, i: int, chunk: torch.Tensor, *, written: bool) -> None:
        """Chunk ``i`` decoded and verified: hand it to the sink unless it was decoded into the sink already."""
        if not written:
            size = self.chunk_size
            with self._write_lock:
                self.job.sink.write(i * size, (i + 1) * size, chunk)
        self.ok[i] = True
