"""Moving chunk bytes between tiers and the engine in overlapping windows, on a small thread pool.

Retrieve: the chunks a tier holds are cut into windows of ``WINDOW_BYTES`` of KV, larger for a long prefix
from a tier with ``large_load_windows`` (up to ``MAX_WINDOW_BYTES``, see ``Pipeline.windows``); each window
is one task that reads its blobs (``tier.get``, pinned until the task ends), then takes one of ``DECODERS``
decode slots (one per core), verifies and decodes each chunk, and writes it to the sink. ``READ_AHEAD`` more
tasks than slots are in flight, so the next windows are being read from a slow tier while the cores decode,
and windows decode in parallel (the codecs release the GIL). Measured on 1 GiB of int8 from disk with the page
cache dropped (2 cores): one extra task and no slots took 0.46-0.62 s, three read ahead with two slots
0.35-0.44 s, against 0.45-0.65 s for raw. Correctness does not depend on the overlap:

* a chunk reaches the sink only after ``decode_blob`` verified it (tokens, shape and dtype always, checksum where
  sealed);
* pins are released by the task's own ``with tier.get(...)`` block, on every path, errors included;
* a chunk that fails ends the prefix there: windows wholly after the first failure are not read (the
  chunks of a window already read are all still verified, so corrupt ones are found and deleted), and the
  caller keeps only the leading run of loaded chunks (the sink may hold later chunks; only the returned
  number of tokens is valid, as ``KVCache.retrieve`` documents).

Chunks are decoded straight into the sink's memory where it lends it (``destination``, as ``TensorSink`` does
for a CPU tensor): no chunk-sized temporary and no second pass over the bytes. Otherwise a codec that can
decode into a buffer (``decode_into``) decodes into its worker's reused scratch chunk, which is then handed to
the sink's ``write``; fresh chunk-sized tensors would cost a page fault per 4 KiB (~1 GB/s here, slower
than int8's decode). Sinks receive writes from worker threads; one at a time unless the sink sets
``concurrent_writes = True`` (disjoint token ranges may then be written in parallel). A sink that goes on
reading a chunk after ``write`` returns (the vLLM connector's DMA to a GPU straight out of the memory tier's
pinned buffer) has ``settle`` called before the scratch is decoded into again and before a window's pins are
released.

Chunks that are copies and nothing else -- raw chunks from a tier in this process's memory -- are one window
run in the calling thread: nothing overlaps, torch spreads each copy over the cores itself, a hop to the
pool costs ~0.1 ms per window, and the chunks are all checked first and then copied in one call (on 512
MiB of 8B-shaped KV in the memory tier, retrieve went from 0.78-0.83 of one flat copy of the same bytes to
0.87 in the calling thread, 0.88-0.90 copying back to back and 0.91-0.94 in one call; store from 0.77-0.81
to 0.84).

Store: chunks are encoded window by window on the pool while the calling thread hands finished windows to
``tier.put`` in order, so encoding window i+1 overlaps writing window i, and windows encode in parallel. A
codec that only copies (raw: the tier's ``put`` does the one copy) is put window by window from the
calling thread, and into a tier in this process's memory as one put, which the memory tier writes with its
copies in one call (store: 0.83-0.90 -> 0.91-0.98 of a flat copy into the tier's buffer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from kvtier.base.errors import BlobError, KVTierError
from kvtier.base.keys import ChunkHash
from kvtier.base.layout import KVSpec
from kvtier.base.metrics import Metrics
from kvtier.codecs.base import copy_tensors
from kvtier.codecs.blob import decode_blob, encode_blob
from kvtier.tiers import Tier

log = logging.getLogger(__name__)

#: KV bytes per task, at least: big enough that a task's overhead is noise, small enough that a few windows are
#: in flight for a prefix of a hundred MiB.
WINDOW_BYTES = 16 << 20
#: KV bytes per task, at most: a long prefix loaded from a tier with ``large_load_windows`` gets windows up to
#: this size, as long as every worker still has ``WINDOWS_PER_WORKER`` of them. See ``Pipeline.windows``.
MAX_WINDOW_BYTES = 64 << 20
#: windows per worker a long prefix is cut into, at least (enough that reads and decodes overlap to the end)
WINDOWS_PER_WORKER = 3
#: windows decoding at once: one per core (more only contend for the cores and the GIL)
DECODERS = os.cpu_count() or 1
#: windows read ahead of the decoders: their reads overlap the decodes, so a slow tier's bandwidth and the
#: cores are both kept busy. A read-ahead window holds its read buffers (compressed bytes) until decoded.
READ_AHEAD = 3
#: tasks in flight
WORKERS = DECODERS + READ_AHEAD
#: windows encoded ahead of the one being written on store (bounds the memory held by encoded payloads)
STORE_AHEAD = 4
#: KV bytes per window of a store from a source on a GPU into a tier in this process's memory: the chunks of a
#: window are gathered in GPU memory (borrowed beside the engine's) before their copies to the host run, and
#: at most three windows are there at once (one being copied, one gathered ahead, one being gathered)
DEVICE_WINDOW_BYTES = 128 << 20


class Pipeline:
    """The thread pool and the windowing shared by a KVCache's retrieve and store. Thread-safe."""

    def __init__(self, spec: KVSpec | None, chunk_size: int, metrics: Metrics, workers: int | None = None) -> None:
        """``spec``: the model's attention KV (None for a model without attention: nothing to move)."""
        chunk_bytes = spec.bytes_per_token * chunk_size if spec is not None else 0
        self.per_window = max(1, WINDOW_BYTES // max(chunk_bytes, 1))  # chunks per window, at least
        self.max_per_window = max(self.per_window, MAX_WINDOW_BYTES // max(chunk_bytes, 1))
        self.chunk_size = chunk_size
        self.per_device_window = max(1, DEVICE_WINDOW_BYTES // max(chunk_bytes, 1))
        self.metrics = metrics
        self._chunk = (spec.chunk_shape(chunk_size), spec.dtype) if spec is not None else None
        self._scratch = threading.local()  # per worker: one decoded chunk for sinks without a destination
        self._workers = workers or WORKERS
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._decoding = threading.Semaphore(DECODERS)  # decode slots, shared by concurrent retrieves

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="kvtier-io")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def windows(self, idx: Sequence[int], *, grow: bool) -> Iterator[Sequence[int]]:
        """``idx`` cut in order into windows of equal size: ``per_window`` chunks, or with ``grow`` more (up to
        ``max_per_window``) while every worker still gets ``WINDOWS_PER_WORKER`` windows.

        Loads from a tier with ``large_load_windows`` grow their windows. Each window costs thread hand-offs (a
        task, a decode slot, a ``get`` whose reads fan out to the disk tier's readers), and the more threads want
        the GIL, the longer the cores sit idle. On 1 GiB of SmolLM2 KV from disk (2 cores, page cache dropped, 20
        interleaved runs), lossless took a median of 0.512 s in 16 MiB windows and 0.450 s in windows grown to 64
        MiB, using 1.72 cores instead of 1.56 and 0.72 s of CPU instead of 0.93; raw and int8 did not change. From
        the memory tier int8 and lossless gained 3-5%. From Redis, whose ``get`` is one reply stream per server that
        must arrive whole before its chunks decode, raw lost a third (median 0.56 -> 0.76 s), so network tiers keep
        ``per_window``. Fixed 64 MiB windows made 256 MiB slower (four windows for five workers), and windows that
        shrank towards the end of the prefix were slower than equal ones. Stores keep ``per_window`` too: they put
        windows in order, and 64 MiB windows made a 1 GiB store to disk slower (lossless 1.32 -> 1.68 s, int8 0.87
        -> 1.10 s, medians of four)."""
        per = self.per_window
        if grow:
            per = min(self.max_per_window, max(per, len(idx) // (WINDOWS_PER_WORKER * self._workers)))
        for start in range(0, len(idx), per):
            yield idx[start : start + per]

    # -- retrieve ------------------------------------------------------------------------------------------
    def load(self, tiers: Sequence[Tier], keys: Sequence[ChunkHash], where: Sequence[int | None],
             token_ids: np.ndarray, sink, promote: Callable[[int, np.ndarray, torch.Tensor, int], None],
             on_error: Callable[[Tier, str, KVTierError], None]) -> list[bool]:
        """Load every located chunk into ``sink``; True per chunk that arrived verified.

        ``promote(i, tokens, chunk, tier_index)`` is called (from a worker, before the chunk's pins are
        released) for chunks found below the first tier; ``on_error`` for a tier that failed.
        """
        state = _LoadState(len(keys), sink, self._chunk[0] if self._chunk is not None else None)
        tasks = []
        for t, tier in enumerate(tiers):
            idx = [i for i, w in enumerate(where) if w == t]
            if idx and _copies_only(tier):  # one window: its chunks are all checked, then copied back to back
                tasks.append((tier, t, idx))
                continue
            for window in self.windows(idx, grow=getattr(tier, "large_load_windows", False)):
                tasks.append((tier, t, window))
        # A single window, and copy-only windows, run in the calling thread: there is nothing to overlap (torch
        # spreads a copy over the cores itself), and a thread hop costs ~0.1 ms per window.
        pooled, inline = [], tasks
        if len(tasks) > 1:
            pooled = [task for task in tasks if not _copies_only(task[0])]
            inline = [task for task in tasks if _copies_only(task[0])]
        futures = []
        if pooled:
            pool = self._executor()
            # Workers write into the caller's tensors: under inference mode those are inference tensors, which
            # only code in inference mode may update, and the mode is per thread.
            mode = torch.is_inference_mode_enabled()
            futures = [pool.submit(self._load_window_in_mode, mode, tier, t, window, keys, token_ids, state,
                                   promote, on_error) for tier, t, window in pooled]
        try:
            for tier, t, window in inline:
                self._load_window(tier, t, window, keys, token_ids, state, promote, on_error)
        finally:
            wait(futures)  # all of them, even after one raised: none may touch the sink after we return
        for future in futures:
            future.result()  # an engine's sink error reaches the caller, as it did without the pipeline
        return state.ok

    def _load_window_in_mode(self, inference_mode: bool, *args) -> None:
        with torch.inference_mode(inference_mode):
            self._load_window(*args)

    def _load_window(self, tier: Tier, t: int, window: Sequence[int], keys, token_ids, state: _LoadState,
                     promote, on_error) -> None:
        """Read, verify and decode the window's chunks into the sink. Copy-only chunks are all checked first and
        then copied in one call: Python work between copies slowed them by 5-8% (measured on 32 MiB chunks:
        0.94-0.97 of one flat copy back to back, 0.86-0.89 interleaved with the checks)."""
        if window[0] > state.first_bad:
            return  # the prefix already ends before this window: reading it would be wasted
        bad: list[ChunkHash] = []
        size = self.chunk_size
        copy_only = _copies_only(tier)
        try:
            with tier.get([keys[i] for i in window]) as blobs, self._decoding:
                try:
                    checked = []
                    for i, blob in zip(window, blobs):
                        if blob is None:
                            state.fail(i)
                            continue
                        start, end = i * size, (i + 1) * size
                        dest = None if copy_only else state.destination(start, end)
                        scratch = self._buffer(tier) if dest is None and not copy_only else None
                        try:
                            chunk = decode_blob(blob, keys[i], token_ids[start:end], codec=tier.codec,
                                                verify=tier.verifies, out=dest if dest is not None else scratch,
                                                expect=self._chunk)
                        except BlobError as exc:
                            self.metrics.inc("kvtier_corrupt_chunks_total", tier=tier.name)
                            log.warning("tier %s: chunk %s is a miss: %s", tier.name, keys[i].hex()[:16], exc)
                            bad.append(keys[i])
                            state.fail(i)
                            continue
                        if copy_only:
                            checked.append((i, chunk, blob.nbytes))
                        else:
                            self._arrived(tier, t, i, chunk, blob.nbytes, dest is not None, token_ids, state, promote)
                            if scratch is not None:
                                state.settle()  # the scratch is decoded into again next
                    dests = [state.destination(i * size, (i + 1) * size) for i, _, _ in checked]
                    copy_tensors([(d, c) for d, (_, c, _) in zip(dests, checked) if d is not None])
                    for dest, (i, chunk, nbytes) in zip(dests, checked):
                        self._arrived(tier, t, i, chunk, nbytes, dest is not None, token_ids, state, promote)
                finally:
                    state.settle()  # the sink is done reading the blobs before their pins are released
        except KVTierError as exc:
            for i in window:
                state.fail(i)
            on_error(tier, "get", exc)
        if bad:
            try:
                tier.delete(bad)
            except KVTierError as exc:
                on_error(tier, "delete", exc)

    def _arrived(self, tier: Tier, t: int, i: int, chunk: torch.Tensor, nbytes: int, written: bool, token_ids,
                 state: _LoadState, promote) -> None:
        """Chunk ``i`` is verified and decoded: into the sink (unless ``written`` there already), counted, and
        promoted into the faster tiers when it came from a slower one."""
        size = self.chunk_size
        state.arrived(i, i * size, (i + 1) * size, chunk, written=written)
        self.metrics.inc("kvtier_read_bytes_total", nbytes, tier=tier.name)
        if t > 0:
            promote(i, token_ids[i * size : (i + 1) * size], chunk, t)

    def _buffer(self, tier: Tier) -> torch.Tensor | None:
        """This worker's scratch chunk, for a codec that decodes into memory; None for one whose ``decode``
        costs nothing (raw views the blob, and the sink's ``write`` is then the only copy)."""
        if self._chunk is None or getattr(tier.codec, "decode_into", None) is None:
            return None
        buf = getattr(self._scratch, "chunk", None)
        if buf is None:
            shape, dtype = self._chunk
            buf = self._scratch.chunk = torch.empty(shape, dtype=dtype)
        return buf

    # -- store ---------------------------------------------------------------------------------------------
    def encode_and_put(self, tier: Tier, missing: Sequence[int], keys: Sequence[ChunkHash], token_ids: np.ndarray,
                       source, on_error: Callable[[Tier, str, KVTierError], None]) -> list[int]:
        """Encode the ``missing`` chunks of ``source`` for ``tier`` window by window on the pool, putting each
        window in order as soon as it is encoded; return the indices the tier stored. A KVTierError (an
        encode or a put that failed) goes to ``on_error`` and ends the store there, after the encodes in
        flight have finished (so ``source`` is no longer read when this returns)."""
        size = self.chunk_size

        def encode(window: Sequence[int]) -> list:
            return [(keys[i], encode_blob(keys[i], token_ids[i * size : (i + 1) * size], tier.codec,
                                          source.chunk(i * size, (i + 1) * size), seal=tier.verifies))
                    for i in window]

        # Copy-only chunks into a tier in this process's memory are one put: the tier writes them all at once.
        # From a source on a GPU, windows bound the GPU memory the gathered chunks take, and the pool gathers the
        # next window while this thread waits for the copies of the last: the GPU's copy engine is kept busy.
        on_gpu = str(getattr(source, "device", "cpu")) != "cpu"
        ahead = STORE_AHEAD
        if on_gpu and _copies_only(tier):
            per, ahead = self.per_device_window, 1
            windows = [missing[start : start + per] for start in range(0, len(missing), per)]
        elif _copies_only(tier):
            windows = [missing]
        else:
            windows = list(self.windows(missing, grow=False))
        done: list[int] = []
        if len(windows) == 1 or (getattr(tier.codec, "copies_only", False) and not on_gpu):  # nothing to overlap
            try:
                for window in windows:
                    done.extend(i for i, s in zip(window, tier.put(encode(window))) if s)
            except KVTierError as exc:
                on_error(tier, "put", exc)
            return done
        pool = self._executor()
        pending: deque[tuple[Sequence[int], Future]] = deque()

        def put_oldest() -> None:
            window, future = pending.popleft()
            done.extend(i for i, s in zip(window, tier.put(future.result())) if s)

        try:
            for window in windows:
                pending.append((window, pool.submit(encode, window)))
                if len(pending) > ahead:
                    put_oldest()
            while pending:
                put_oldest()
        except KVTierError as exc:
            on_error(tier, "put", exc)
        finally:
            for _, future in pending:  # something failed: let the encodes in flight end before the source may go
                future.exception()
        return done


def _copies_only(tier: Tier) -> bool:
    """A tier in this process's memory (it does not verify: its bytes never leave the process) with a codec that
    only copies (raw decodes to a view of the blob): loading from it is the sink's copy and nothing else."""
    return not tier.verifies and getattr(tier.codec, "copies_only", False)


class _LoadState:
    """What the windows of one retrieve share: which chunks arrived, the first failure, the sink's lock."""

    def __init__(self, n: int, sink, chunk_shape: tuple[int, ...] | None) -> None:
        self.ok = [False] * n
        self._shape = chunk_shape
        self.first_bad = n
        self._sink = sink
        self._lend = getattr(sink, "destination", None)  # KVSink's optional capability (kvtier.core.cache)
        self._lock = threading.Lock()
        self._write_lock = contextlib.nullcontext() if getattr(sink, "concurrent_writes", False) else threading.Lock()
        self._settle = getattr(sink, "settle", None)  # KVSink's optional capability (kvtier.core.cache)

    def fail(self, i: int) -> None:
        with self._lock:
            self.first_bad = min(self.first_bad, i)

    def destination(self, start: int, end: int) -> torch.Tensor | None:
        """The sink's memory for tokens ``[start, end)``, if it lends it. One of the wrong shape or device is the
        sink's error (ValueError, to the caller), never taken for a corrupt chunk."""
        dest = self._lend(start, end) if self._lend is not None else None
        if dest is not None and (tuple(dest.shape) != self._shape or dest.device.type != "cpu"):
            raise ValueError(f"sink lent a {tuple(dest.shape)} tensor on {dest.device} for tokens [{start}, {end}), "
                             f"not {self._shape} on the CPU")
        return dest

    def settle(self) -> None:
        """Let the sink finish reading every chunk written so far (a no-op for sinks that copy in ``write``)."""
        if self._settle is not None:
            with self._write_lock:
                self._settle()

    def arrived(self, i: int, start: int, end: int, chunk: torch.Tensor, *, written: bool) -> None:
        """Chunk ``i`` decoded and verified: hand it to the sink unless it was decoded into the sink already."""
        if not written:
            with self._write_lock:
                self._sink.write(start, end, chunk)
        self.ok[i] = True
