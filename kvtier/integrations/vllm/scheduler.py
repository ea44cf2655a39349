"""Scheduler side of the connector: decides what to load and what to save, never touches KV.

* ``matched_tokens`` answers from the request's lookup (lookups.py: asked when the request arrived, cached,
  a miss past its deadline) and promises vLLM the part beyond its own prefix-cache hit, always leaving at least
  one token for vLLM to compute. It answers ``None`` ("ask again") only while chunks vLLM lacks are being
  loaded or saved for another request (once they land, vLLM's prefix cache or kvtier has them), and, for an
  asynchronous load, while vLLM's blocks, counted over every KV cache group by vLLM's own accounting, cannot
  take it without a preemption or a deadlock (``_room_for``, room.py).
* Asynchronous loads (the default): vLLM parks the request in ``WAITING_FOR_REMOTE_KVS`` with its blocks
  allocated; the :class:`LoadSpec` goes to the workers in the next step's metadata, and the request stays
  "loading" (its chunks in flight) until every rank reported it in ``finished_recving``. Synchronous loads
  (``load_mode: "sync"``) become a LoadSpec in the step that schedules the request.
* Saves as KV is computed: every step, each scheduled request's full prompt chunks computed by earlier steps
  (and not already held by kvtier or ordered) become a save job; when a request finishes, its remaining
  computed full chunks do. ``finished`` returns True (vLLM keeps the blocks) while a job of the request is not
  over on every rank; the workers then report the request in ``finished_sending``. A job's chunks count as in
  flight until every rank reported the job over (``KVTierWorkerMeta``).
* Sliding-window groups (vLLM's hybrid manager, groups.py): the full-attention group's blocks are saved and
  loaded as above; the windows before the prompt's chunk boundaries that a step computes (those the snapshot
  policy picks) become a ``WindowSave`` in that step's metadata, copied by the workers right after its forward
  pass (the next step frees blocks that left the window). A load restores the window at its last boundary too;
  one that falls short is reported per request (``loads_failed``), and vLLM recomputes that request whole.
* Disaggregated prefill and decode (pd.py): a prefill's whole prompt is a ``TransferSpec`` stored before the
  step that computes it ends, and ``request_finished`` hands its decode instance the params to load it; a
  decode's prompt, up to the block of its last token (whole blocks only, pd.loadable_tokens), is promised as an
  asynchronous load without a lookup.
* Keys: a request's tokens plus what else vLLM keys its blocks with (inputs.py: LoRA, cache salt, multimodal
  inputs, prompt embeddings), read once per request. A request with an input kvtier cannot key is neither
  looked up, loaded nor stored; ``uncached`` counts such requests by kind, and each kind is logged once.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvtier.base.keys import ChunkHash, ExtraKeys, chunk_hashes
from kvtier.base.state import SnapshotPolicy
from kvtier.integrations.vllm.groups import SINGLE_GROUP, GroupLayout
from kvtier.integrations.vllm.inputs import Unkeyable, request_extras, request_salt, request_ttl, unhandled_fields
from kvtier.integrations.vllm.lookups import Lookups
from kvtier.integrations.vllm.metadata import (
    KVTierMetadata,
    KVTierWorkerMeta,
    LoadSpec,
    SaveSpec,
    WindowSave,
    pack_extras,
    pack_tokens,
)
from kvtier.integrations.vllm.pd import PDRequests
from kvtier.integrations.vllm.pd_scheduler import PDScheduling
from kvtier.integrations.vllm.room import Room

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
EVERY_BOUNDARY = SnapshotPolicy(interval=1, last=False)


class SchedulerSide(PDScheduling):
    def __init__(self, chunk_size: int, block_size: int, lookups: Lookups, *, load_async: bool = True,
                 load_timeout_s: float = 30.0, tp_size: int = 1, groups: GroupLayout = SINGLE_GROUP,
                 snapshots: SnapshotPolicy = EVERY_BOUNDARY) -> None:
        """``groups``: vLLM's KV cache groups (groups.py); with sliding-window groups, ``snapshots`` chooses the
        boundaries whose windows are stored."""
        self.chunk_size, self.block_size = chunk_size, block_size
        self.groups, self.snapshots = groups, snapshots
        self.lookups = lookups
        self.load_async, self.load_timeout_s, self.tp_size = load_async, load_timeout_s, tp_size
        self.kv_cache_manager: Any = None  # bound by vLLM: a running request's block ids
        self._requests: dict[str, Request] = {}  # unfinished requests vLLM told us about
        self._plans: dict[str, tuple[int, int]] = {}  # req_id -> (vLLM's hit, end of kvtier's)
        self._hits: dict[str, int] = {}  # req_id -> tokens kvtier held when the request was scheduled
        self._sync_loads: dict[str, tuple[Request, int, int]] = {}
        self._ready: list[LoadSpec] = []  # asynchronous loads for the next metadata
        self._loading: dict[str, list[ChunkHash]] = {}  # req_id -> chunks of its asynchronous load in flight
        self._load_blocks: dict[str, set[int]] = {}  # req_id -> blocks its last load was to fill
        self._recompute: set[str] = set()  # requests whose load failed: vLLM computes the rest, no more loads
        self._in_flight: Counter[ChunkHash] = Counter()  # chunks being loaded or saved
        self._saves: list[SaveSpec] = []
        self._delayed: set[str] = set()
        self._ordered: dict[str, int] = {}  # req_id -> tokens ordered saved so far
        self._jobs: dict[int, tuple[str, list[ChunkHash]]] = {}  # job -> (req_id, chunks), until over on all ranks
        self._acks: Counter[int] = Counter()
        self._req_jobs: Counter[str] = Counter()  # req_id -> its jobs not over on every rank
        self._next_job = 0
        self._ttls: dict[str, float | None] = {}  # req_id -> its stores' retention time (request_ttl)
        self._parked: dict[str, tuple[int, int]] = {}  # req_id -> (blocks held, lacking to run) until it runs
        self._running: dict[str, int] = {}  # req_id -> tokens vLLM scheduled for it in the last step
        self.deferred_loads = 0  #: hits answered "ask again" because vLLM's cache lacked room for them then
        self.ignored_params = 0  #: requests whose kv_transfer_params for kvtier were malformed (ignored)
        self._reported = (0, 0)  # (deferred_loads, ignored_params) at the last take_counters()
        self._unhandled = unhandled_fields()
        self._inputs: dict[str, tuple[bytes, ExtraKeys] | None] = {}  # req_id -> (salt, extras); None: uncached
        self.uncached: Counter[str] = Counter()  #: requests not cached, by the kind of input kvtier could not key
        self._uncached_reported: Counter[str] = Counter()
        self.pd = PDRequests()  #: disaggregated prefills and decodes (kvtier.integrations.vllm.pd)

    def close(self) -> None:
        self.lookups.close()

    def take_counters(self) -> list[list[Any]]:
        """How much ``deferred_loads`` and ``ignored_params`` grew since the last call, as KVTierStats counter
        series (vLLM asks the scheduler's connector for its stats every step and exports them)."""
        now = (self.deferred_loads, self.ignored_params)
        names = ("kvtier_engine_deferred_loads_total", "kvtier_engine_ignored_params_total")
        grown = [[name, {}, new - old] for name, new, old in zip(names, now, self._reported) if new > old]
        self._reported = now
        grown += [["kvtier_engine_uncached_requests_total", {"kind": kind}, n - self._uncached_reported[kind]]
                  for kind, n in self.uncached.items() if n > self._uncached_reported[kind]]
        self._uncached_reported = self.uncached.copy()
        return grown

    def _keys(self, tokens: list[int], inputs: tuple[bytes, ExtraKeys]) -> list[ChunkHash]:
        """Scheduler-local chunk identities, only compared with each other (not kvtier's keys)."""
        salt, extras = inputs
        root = ChunkHash(hashlib.sha256(b"kvtier/vllm\0" + salt).digest())
        return chunk_hashes(root, tokens, self.chunk_size, extras)

    def _request_inputs(self, request: Request) -> tuple[bytes, ExtraKeys] | None:
        """The request's salt and extra keys, read once per request; None if it has an input kvtier cannot key
        (counted once per request, logged once per kind)."""
        req_id = request.request_id
        if req_id not in self._inputs:
            try:
                self._inputs[req_id] = (request_salt(request),
                                        request_extras(request, self.chunk_size, self._unhandled))
            except Unkeyable as exc:
                if not self.uncached[exc.kind]:
                    log.warning("kvtier: request %s has an input kvtier cannot key (%s): such requests are neither "
                                "loaded nor stored", req_id, exc)
                self.uncached[exc.kind] += 1
                self._inputs[req_id] = None
        return self._inputs[req_id]

    def _usable(self, request: Request) -> list[int]:
        tokens = list(request.all_token_ids)
        return tokens[: len(tokens) - len(tokens) % self.chunk_size]

    def _lookup_tokens(self, request: Request) -> list[int]:
        """The tokens to look up: the request's full chunks; with Mamba groups only those before its last token,
        since a load must end on a boundary with a stored state and vLLM computes at least one token."""
        if not self.groups.ssm:
            return self._usable(request)
        n = request.num_tokens - 1
        return list(request.all_token_ids[: n - n % self.chunk_size])

    # -- lookups -------------------------------------------------------------------------------------------
    def new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        if self.groups.full is not None and not self.groups.states:  # P/D moves full-attention KV only
            self.pd.new_request(request)
        if request.request_id in self.pd.decodes:
            return  # its prefill instance stored the prompt: no lookup to ask
        tokens = self._lookup_tokens(request)
        inputs = self._request_inputs(request) if tokens else None
        if inputs is not None:
            self.lookups.ask(request.request_id, tokens, *inputs)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests.setdefault(request.request_id, request)
        if request.request_id in self.pd.decodes and request.request_id not in self._recompute:
            return self._remote_prefill(request, num_computed_tokens)
        tokens = self._lookup_tokens(request)
        if not tokens or request.request_id in self._recompute:
            return 0, False
        inputs = self._request_inputs(request)
        if inputs is None:
            return 0, False
        if self._in_flight:
            beyond_vllm = self._keys(tokens, inputs)[num_computed_tokens // self.chunk_size :]
            if any(k in self._in_flight for k in beyond_vllm):
                return None, False  # loading or saving for another request: ask again next step, then hit
        hit = self.lookups.answer(request.request_id, tokens, *inputs)
        self._hits[request.request_id] = hit
        end = min(hit, request.num_tokens - 1)  # vLLM must compute at least one token
        if end <= num_computed_tokens:
            return 0, False
        room = self._room_for(request, num_computed_tokens, end) if self.load_async else True
        if not room:
            return (None if room is None else 0), False  # ask again; never room beside its load: vLLM computes
        self._plans[request.request_id] = (num_computed_tokens, end)
        return end - num_computed_tokens, self.load_async

    def _room_for(self, request: Request, computed: int, end: int) -> bool | None:
        """Promise a load of ``[computed, end)`` now (True), not yet (None: ``deferred_loads``) or never (False),
        by ``Room.admits``. Without vLLM's KV cache manager bound, or while nothing holds blocks that it will give
        back, the hit is promised as vLLM would admit it."""
        if self.kv_cache_manager is None:
            return True
        room = Room(self.kv_cache_manager)
        try:
            park, lack = room.park_and_lack(request, computed, end)
            running = [(self._requests[r], n) for r, n in self._running.items() if r in self._requests]
            steps = sum(room.step(r, n, self.block_size) for r, n in running)
        except Exception:  # a vLLM whose accounting differs: never raise into its scheduler; vLLM's gate remains
            log.exception("kvtier: vLLM's block counts could not be read; the load is promised unchecked")
            return True
        answer = room.admits(park, lack, list(self._parked.values()), steps)
        if answer is None and not self._parked and not self._running:
            answer = True
        self.deferred_loads += answer is None
        return answer

    def after_alloc(self, request: Request, tables: tuple[list[int], ...], num_external_tokens: int) -> None:
        """``tables``: the request's block ids in every KV cache group."""
        plan = self._plans.pop(request.request_id, None)
        if num_external_tokens <= 0 or plan is None:
            return
        self.lookups.forget(request.request_id)
        first, end = plan[0], plan[0] + num_external_tokens
        if not self.load_async and request.request_id not in self.pd.decodes:
            self._sync_loads[request.request_id] = (request, first, end)
            return
        spec, inputs = self._load_spec(request, tables, first, end)
        if self.kv_cache_manager is not None:
            self._parked[request.request_id] = (Room.held(tables), Room(self.kv_cache_manager).lack(request, end))
        keys = self._keys(self._usable(request)[: -(-end // self.chunk_size) * self.chunk_size], inputs)
        keys = keys[first // self.chunk_size :]
        self._loading[request.request_id] = keys
        self._in_flight.update(keys)
        self._ready.append(spec)

    def _load_spec(self, request: Request, tables: tuple[list[int], ...], first: int,
                   end: int) -> tuple[LoadSpec, tuple[bytes, ExtraKeys]]:
        """The load of tokens ``[first, end)`` into the request's blocks (``tables``: per KV cache group), and
        the request's inputs (never None here: ``matched_tokens`` promises no load to a request it cannot key)."""
        block_ids = list(tables[self.groups.full]) if self.groups.full is not None else []
        windows = tuple(list(tables[g]) for g in self.groups.states)
        ticket = self.pd.decodes.pop(request.request_id, None)  # one remote prefill per request
        read_end = -(-end // self.chunk_size) * self.chunk_size
        if ticket:  # the full chunks up to ``end`` and the tail's tokens after the last one (transfer.py)
            read_end = min(read_end, request.num_prompt_tokens)
        self._load_blocks[request.request_id] = set(block_ids[first // self.block_size : -(-end // self.block_size)])
        tokens = pack_tokens(list(request.all_token_ids[:read_end]))
        timeout = self.load_timeout_s if self.load_async or ticket else None
        inputs = self._request_inputs(request)
        assert inputs is not None
        salt, extras = inputs
        spec = LoadSpec(request.request_id, tokens, salt, block_ids, first, end, timeout, pack_extras(extras), windows,
                        ticket.nonce if ticket else b"")
        return spec, inputs

    # -- each step -----------------------------------------------------------------------------------------
    def build_meta(self, out: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata(loads=self._ready, preempted=set(out.preempted_req_ids or ()))
        self._ready = []
        for new in out.scheduled_new_reqs:
            if new.req_id in self._sync_loads:
                meta.loads.append(self._sync_spec(new.req_id, new.block_ids))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._sync_loads and req_id in cached.resumed_req_ids and cached.new_block_ids[i]:
                meta.loads.append(self._sync_spec(req_id, cached.new_block_ids[i]))
        self._sync_loads.clear()
        self._plans.clear()
        for req_id in out.num_scheduled_tokens:
            self._parked.pop(req_id, None)  # running: vLLM allocated its blocks
        self._running = dict(out.num_scheduled_tokens)
        if self.kv_cache_manager is not None:
            for req_id, n_scheduled in out.num_scheduled_tokens.items():
                request = self._requests.get(req_id)
                if request is not None and req_id in self.pd.prefills:
                    self._order_transfer(request, n_scheduled, meta)
                elif request is not None and req_id not in self._loading:
                    # full prompt chunks computed by earlier steps: this step's forward pass writes none of them
                    limit = min(request.num_computed_tokens, request.num_prompt_tokens)
                    if self.groups.full is not None:
                        self._order_save(request, limit,
                                         lambda r=req_id: self.kv_cache_manager.get_block_ids(r)[self.groups.full])
                    if self.groups.states:
                        self._order_windows(meta, request, out.num_scheduled_tokens[req_id])
        meta.saves, self._saves = self._saves, []
        meta.delayed, self._delayed = self._delayed, set()
        return meta

    def _sync_spec(self, req_id: str, tables: tuple[list[int], ...]) -> LoadSpec:
        request, first, end = self._sync_loads[req_id]
        return self._load_spec(request, tables, first, end)[0]

    def _order_windows(self, meta: KVTierMetadata, request: Request, scheduled: int) -> None:
        """The windows before the prompt's chunk boundaries that this step computes and the snapshot policy picks
        (none that the request's hit restored), to copy after this step's forward pass. Mamba groups hold a
        state only where a step ends (mamba.py): only a boundary this step ends on is copied."""
        inputs = self._request_inputs(request)
        done, size = request.num_computed_tokens, self.chunk_size
        upto = min(done + scheduled, request.num_prompt_tokens)
        if self.groups.ssm and upto != done + scheduled:
            return  # decoding: the state block moves on with every token
        lowest = upto if self.groups.ssm else done + 1
        hit = self._hits.get(request.request_id, 0) // size
        chosen = [k * size for k in self.snapshots.boundaries(hit, request.num_prompt_tokens, size)
                  if lowest <= k * size <= upto]
        if not chosen or inputs is None:
            return
        tables = self.kv_cache_manager.get_block_ids(request.request_id)
        meta.windows.append(WindowSave(request.request_id, pack_tokens(list(request.all_token_ids[: chosen[-1]])),
                                       inputs[0], chosen, tuple(list(tables[g]) for g in self.groups.states),
                                       pack_extras(inputs[1])))

    def _order_save(self, request: Request, n_tokens: int, block_ids) -> None:
        """A save job of the request's full chunks below ``n_tokens`` not held or ordered yet."""
        req_id = request.request_id
        n = n_tokens - n_tokens % self.chunk_size
        start = max(self._ordered.get(req_id, 0), self._hits.get(req_id, 0))
        inputs = self._request_inputs(request)
        if n <= start or inputs is None:
            return
        tokens = list(request.all_token_ids[:n])
        keys = self._keys(tokens, inputs)[start // self.chunk_size :]
        job, self._next_job = self._next_job, self._next_job + 1
        self._jobs[job] = (req_id, keys)
        self._in_flight.update(keys)
        self._req_jobs[req_id] += 1
        self._ordered[req_id] = n
        self._saves.append(SaveSpec(req_id, job, pack_tokens(tokens), inputs[0], list(block_ids()), self._ttl(request),
                                    pack_extras(inputs[1])))

    def _ttl(self, request: Request) -> float | None:
        """``request_ttl`` once per request: a malformed value is warned about and counted once."""
        req_id = request.request_id
        if req_id not in self._ttls:
            try:
                self._ttls[req_id] = request_ttl(request)
            except ValueError as exc:
                self.ignored_params += 1
                log.warning("kvtier: request %s: %s; ignored: its stores keep no retention time", req_id, exc)
                self._ttls[req_id] = None
        return self._ttls[req_id]

    def finished(self, request: Request, block_ids: list[int]) -> bool:
        """Order a save of the request's remaining computed full chunks; True when vLLM must keep its blocks
        until the workers report the request."""
        req_id = request.request_id
        self._plans.pop(req_id, None)
        self._requests.pop(req_id, None)
        self.lookups.forget(req_id)
        if req_id not in self._loading:  # aborted while loading: vLLM keeps the blocks until the load is over
            n = min(request.num_computed_tokens, len(block_ids) * self.block_size)
            self._order_save(request, n, lambda: block_ids)
        self._hits.pop(req_id, None)
        self._inputs.pop(req_id, None)
        self._ttls.pop(req_id, None)
        self._ordered.pop(req_id, None)
        self._load_blocks.pop(req_id, None)
        self._parked.pop(req_id, None)
        self._recompute.discard(req_id)
        if req_id in self._loading or self._req_jobs[req_id] <= 0:
            return False
        self._delayed.add(req_id)
        return True

    # -- what the workers reported -------------------------------------------------------------------------
    def loads_done(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._in_flight.subtract(self._loading.pop(req_id, ()))
        self._in_flight = +self._in_flight  # drop zero counts

    def loads_failed(self, req_ids: set[str]) -> None:
        """Loads with window groups that fell short (vLLM recomputes those requests whole): as ``load_failed``."""
        self.lookups.changed()
        for req_id in req_ids:
            self._hits[req_id] = 0
            self._recompute.add(req_id)

    def load_failed(self, block_ids: set[int]) -> None:
        """Blocks a worker could not fill: their requests compute the rest themselves (a second load could fail
        the same way, over and over: a tier slower than the deadline) and save again what kvtier lost (it
        deleted chunks that failed verification), so forget those requests' hits."""
        self.lookups.changed()
        for req_id, blocks in self._load_blocks.items():
            if blocks & block_ids:
                self._hits[req_id] = 0
                self._recompute.add(req_id)

    def jobs_done(self, meta: KVTierWorkerMeta | None) -> None:
        """Save jobs over on some ranks; a job over on all of them no longer holds its chunks in flight."""
        if meta is None:
            return
        over = []
        for job, n in meta.jobs.items():
            self._acks[job] += n
            if self._acks[job] >= self.tp_size:
                over.append(job)
        for job in over:
            del self._acks[job]
            req_id, keys = self._jobs.pop(job)
            self._in_flight.subtract(keys)
            self._req_jobs[req_id] -= 1
            if self._req_jobs[req_id] <= 0:
                del self._req_jobs[req_id]
        if over:
            self._in_flight = +self._in_flight
            self.lookups.changed()
