"""Worker side of the connector: owns this rank's KVCache, loads hits into vLLM's blocks, saves computed chunks.

* Loads: asynchronous by default (loader.py: on a thread of their own, reported through ``get_finished``);
  with ``load_mode: "sync"`` they run in ``start_load_kv`` before the forward pass. ``KVCache.retrieve``
  verifies every chunk; whatever of a promised range does not arrive intact (evicted since the lookup, corrupt,
  tier down, too late) is reported block by block and vLLM recomputes it. Nothing unverified reaches vLLM.
* Saves run on one background thread, off the forward path, as jobs the scheduler orders once the chunks are
  computed (save jobs of running requests, then a last one when a request finishes). A job's blocks stay
  unchanged while it runs: a running request's full chunks are never rewritten; a preempted request's blocks
  may be reused by the very step that preempted it, so ``preempted`` drops its queued jobs and cuts its
  running one short before that step's forward pass; a finished request's blocks are freed only after
  ``finished_saves`` returned its id (the scheduler lists such requests in ``KVTierMetadata.delayed``).
  Every job ends (stored, failed or cancelled) in ``done_jobs``, which the scheduler counts per rank.
* Disaggregated prefills (kvtier.integrations.vllm.pd) store their whole prompt in ``store_transfers``, called
  from ``wait_for_save`` of the step that computed it, so vLLM answers only once it is stored.
* A :class:`LookupServer` answers the scheduler's lookups against this rank's cache.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvtier.base.state import StateKind
from kvtier.core.cache import KVCache
from kvtier.integrations.vllm.groups import StateGroups
from kvtier.integrations.vllm.loader import AsyncLoads, retrieve_spec
from kvtier.integrations.vllm.lookup_socket import LookupLimits, LookupServer
from kvtier.integrations.vllm.metadata import LoadSpec, SaveSpec, TransferSpec, WindowSave, unpack_extras, unpack_tokens
from kvtier.integrations.vllm.paged import PagedKV, PagedSink, PagedSource
from kvtier.base.threads import WATCHED
from kvtier.integrations.vllm.threads import name_os_thread
from kvtier.integrations.vllm.transfer import store_transfer

log = logging.getLogger(__name__)


class _Cancelled(Exception):
    """A save job's request was preempted: its blocks may be reused, stop reading them."""


class _JobSource(PagedSource):
    def __init__(self, paged: PagedKV, spec: SaveSpec, cancelled: set[str]) -> None:
        super().__init__(paged, spec.block_ids)
        self.req_id, self.cancelled = spec.req_id, cancelled

    def chunk(self, start: int, end: int) -> torch.Tensor:
        if self.req_id in self.cancelled:
            raise _Cancelled(self.req_id)
        return super().chunk(start, end)


@dataclass(frozen=True)
class _Windows:
    """A WindowSave's snapshots, copied out of vLLM's blocks: ``{boundary in chunks: {WINDOW: tensor}}``."""

    save: WindowSave
    snapshots: dict[int, dict[StateKind, torch.Tensor]]


class WorkerSide:
    def __init__(self, paged: PagedKV, cache: KVCache, socket_path: str, max_lookup_tokens: int,
                 load_timeout_s: float = 30.0, load_nice: int = 0,
                 windows: StateGroups | None = None) -> None:
        """``windows``: the sliding-window or Mamba groups (vLLM's hybrid manager), whose windows or states at
        chunk boundaries are stored as snapshots;
        ``paged`` is then the full-attention group (any group for a model whose every layer slides: its blocks are
        only synchronised, never read)."""
        self.paged, self.cache, self.windows = paged, cache, windows
        self.block_size = paged.block_size
        self.loads = AsyncLoads(paged, cache, load_timeout_s, nice=load_nice, windows=windows)
        self._failed: set[int] = set()
        self._cond = threading.Condition()  # guards everything below, shared with the saving thread
        self._counts: Counter[str] = Counter()
        self._jobs: deque[SaveSpec | _Windows | None] = deque()
        self._running: SaveSpec | None = None
        self._pending: Counter[str] = Counter()  # req_id -> save jobs queued or running
        self._cancelled: set[str] = set()
        self._delayed: set[str] = set()  # finished requests to report once their jobs are done
        self._done_jobs: Counter[int] = Counter()
        # watched: a saver that died would leave every save pending while the rank's /health said ok
        self._saver = WATCHED.watch(threading.Thread(target=self._save_loop, name="kvtier-save", daemon=True))
        self._saver.start()
        self.server = LookupServer(cache, socket_path, LookupLimits(max_tokens=max_lookup_tokens))

    # -- loads ---------------------------------------------------------------------------------------------
    def load_sync(self, specs: Iterable[LoadSpec]) -> None:
        for spec in specs:
            self._load_one(spec)
        self.paged.synchronize()

    def _load_one(self, spec: LoadSpec) -> None:
        got = retrieve_spec(self.cache, spec, PagedSink(self.paged, spec.block_ids, spec.first_token))
        loaded = max(min(got, spec.end) - spec.first_token, 0)
        bs = self.block_size
        bad = spec.block_ids[max(got, spec.first_token) // bs : -(-spec.end // bs)] if got < spec.end else []
        with self._cond:
            self._counts.update(loaded_tokens=loaded, failed_blocks=len(bad))
        if not bad:
            return
        log.warning("kvtier: request %s got %d of %d promised tokens; %d blocks will be recomputed",
                    spec.req_id, max(got - spec.first_token, 0), spec.end - spec.first_token, len(bad))
        self._failed.update(bad)

    def finished_loads(self, finished_req_ids: set[str] | None) -> set[str]:
        """Asynchronous loads over (their failed blocks join ``load_errors`` in the same step, and loads with
        window groups that failed join ``failed_loads``)."""
        done, bad = self.loads.finished(finished_req_ids)
        self._failed.update(bad)
        return done

    def failed_loads(self) -> set[str]:
        """Requests among those ``finished_loads`` reported whose load with window groups fell short."""
        failed, self.loads.failed = self.loads.failed, set()
        return failed

    def load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    # -- saves ---------------------------------------------------------------------------------------------
    def submit_saves(self, saves: Iterable[SaveSpec], delayed: Iterable[str] = ()) -> None:
        with self._cond:
            for spec in saves:
                self._cancelled.discard(spec.req_id)  # a resumed request saves again
                self._pending[spec.req_id] += 1
                self._jobs.append(spec)
            self._delayed.update(delayed)
            self._cond.notify_all()

    def snapshot_windows(self, saves: Iterable[WindowSave]) -> None:
        """After the forward pass: copy each save's windows (or Mamba states) out of vLLM's blocks now (the next
        step may free them) and queue their store. A window vLLM no longer holds whole is skipped."""
        if self.windows is None:
            return
        for save in saves:
            snaps = {}
            for boundary in save.boundaries:
                states = self.windows.snapshot_states(save.block_ids, boundary)
                if states is not None:
                    snaps[boundary // self.cache.chunk_size] = states
            if snaps:
                with self._cond:
                    self._jobs.append(_Windows(save, snaps))
                    self._cond.notify_all()

    def store_transfers(self, specs: Iterable[TransferSpec]) -> None:
        """Store disaggregated prefills' prompts now, on the calling thread (``wait_for_save``: the step, and so
        vLLM's answer, ends after them). A failure is logged and counted: the decode instance recomputes."""
        for spec in specs:
            stored = 0
            try:
                stored = store_transfer(self.cache, self.paged, spec)
            except Exception:  # a bug must not fail the engine's step: the decode side recomputes what is missing
                log.exception("kvtier: storing the prompt of request %s for its decode instance failed", spec.req_id)
            with self._cond:
                self._counts.update(stored_tokens=stored)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Before the forward pass of the step that preempted ``req_ids``: drop their queued save jobs and wait
        until none of them reads their blocks."""
        req_ids = set(req_ids)
        with self._cond:
            if not any(self._pending[r] for r in req_ids):
                return
            self._cancelled |= req_ids
            kept: deque[SaveSpec | None] = deque()
            for spec in self._jobs:
                if isinstance(spec, SaveSpec) and spec.req_id in req_ids:
                    self._job_over(spec, stored=0)
                else:
                    kept.append(spec)
            self._jobs = kept
            while self._running is not None and self._running.req_id in req_ids:
                self._cond.wait()
        self.paged.synchronize_saves()

    def _save_loop(self) -> None:
        name_os_thread("kvtier-save")
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                spec = self._jobs.popleft()
                if spec is None:
                    return
                if isinstance(spec, SaveSpec):
                    self._running = spec
            if isinstance(spec, _Windows):
                self._store_windows(spec)
                continue
            stored = 0
            try:
                stored = self.cache.store(unpack_tokens(spec.tokens), _JobSource(self.paged, spec, self._cancelled),
                                          salt=spec.salt, ttl_s=spec.ttl_s, extras=unpack_extras(spec.extras))
            except _Cancelled:
                log.debug("kvtier: save of preempted request %s cut short", spec.req_id)
            except Exception:  # a bug must not keep vLLM's blocks forever: log it, report the job done
                log.exception("kvtier: saving request %s failed", spec.req_id)
            with self._cond:
                self._running = None
                self._job_over(spec, stored)
                self._cond.notify_all()

    def _store_windows(self, job: _Windows) -> None:
        """The copies own their data: no block of vLLM's is read here."""
        try:
            self.cache.store_states(unpack_tokens(job.save.tokens), job.snapshots, salt=job.save.salt,
                                    extras=unpack_extras(job.save.extras))
        except Exception:  # a bug must not stop the saving thread: the windows are only a future miss
            log.exception("kvtier: storing the windows of request %s failed", job.save.req_id)

    def _job_over(self, spec: SaveSpec, stored: int) -> None:
        """Under ``_cond``."""
        self._pending[spec.req_id] -= 1
        if self._pending[spec.req_id] <= 0:
            del self._pending[spec.req_id]
        self._done_jobs[spec.job] += 1
        self._counts.update(stored_tokens=stored, save_jobs=1)

    def finished_saves(self) -> set[str]:
        """Finished requests (``delayed``) whose save jobs are all over: vLLM may free their blocks."""
        with self._cond:
            done = {r for r in self._delayed if not self._pending[r]}
            self._delayed -= done
            for r in done:
                self._pending.pop(r, None)
                self._cancelled.discard(r)
            if done:
                self._counts.update(saved_requests=len(done))
        return done

    def take_done_jobs(self) -> Counter[int]:
        with self._cond:
            jobs, self._done_jobs = self._done_jobs, Counter()
        return jobs

    def take_counts(self) -> dict[str, int]:
        """Counters since the last call (loaded_tokens, failed_blocks, expired_loads, stored_tokens, ...)."""
        with self._cond:
            counts, self._counts = self._counts, Counter()
        counts.update(self.loads.take_counts())
        return dict(counts)

    def close(self) -> None:
        self.loads.close()
        with self._cond:
            self._jobs.append(None)
            self._cond.notify_all()
        WATCHED.unwatch(self._saver)
        self._saver.join(timeout=30)
        self.server.close()
        self.cache.close()
