"""Asynchronous loads: one thread retrieves hits into vLLM's blocks while vLLM runs other requests.

Contract with vLLM (0.32, ``get_num_new_matched_tokens`` returning ``(n, True)``): the request waits in
``WAITING_FOR_REMOTE_KVS`` and its blocks are neither read nor freed until this rank reports its id in
``get_finished(...)[1]``; the blocks that did not arrive verified are reported through
``get_block_ids_with_load_errors`` no later than that same step, and vLLM recomputes them.

* A load runs through ``KVCache.retrieve``, which writes a chunk only after it verified it. The load's sink
  records which chunks were written; what the load reports as loaded is the contiguous verified prefix.
* Every load has a deadline (``LoadSpec.timeout_s`` after the worker received it, queueing included). A load
  past it, one whose request vLLM finished (aborted) or the engine shutting down **closes** the load's sink:
  under the sink's lock, so a write under way completes first and none starts after; on a GPU the copies
  already queued are waited for. A closed load is reported at once; the retrieve may run on inside a slow tier,
  but it can no longer touch vLLM's blocks, which vLLM may then reuse.
* A load is reported exactly once, with its error blocks in the same ``finished()`` answer.
* A load reads only the chunks from the one holding ``first_token`` (:func:`retrieve_spec`): the chunks below
  it are vLLM's own prefix-cache hit, so they are neither read nor counted in ``kvtier_hit_tokens_total``. A
  closed load's sink refuses writes by raising, so the retrieve ends without counting any of that load's hits.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from kvtier.base.state import StateKind
from kvtier.core.cache import KVCache
from kvtier.integrations.vllm.groups import StateGroups
from kvtier.integrations.vllm.metadata import LoadSpec, unpack_extras, unpack_tokens
from kvtier.integrations.vllm.paged import PagedKV, PagedSink
from kvtier.base.threads import WATCHED
from kvtier.integrations.vllm.threads import name_os_thread
from kvtier.integrations.vllm.transfer import load_tail

log = logging.getLogger(__name__)


class _Closed(Exception):
    """A write into a closed load: the retrieve ends here and counts none of this load's hits."""


class _Shifted:
    """A KVSink for a retrieve that starts ``base`` tokens into the request: writes go to ``sink`` shifted."""

    def __init__(self, sink, base: int) -> None:
        self.sink, self.base = sink, base

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        self.sink.write(start + self.base, end + self.base, chunk)

    def settle(self) -> None:
        settle = getattr(self.sink, "settle", None)  # a sink without it reads nothing after ``write`` returns
        if settle is not None:
            settle()


class _Clipped:
    """Writes only the rows before token ``limit`` (a block boundary) of what it is given."""

    def __init__(self, sink, limit: int) -> None:
        self.sink, self.limit = sink, limit

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        stop = min(end, self.limit)
        if stop > start:
            self.sink.write(start, stop, chunk[:, :, : stop - start])

    def settle(self) -> None:
        settle = getattr(self.sink, "settle", None)
        if settle is not None:
            settle()


def retrieve_spec(cache: KVCache, spec: LoadSpec, sink) -> int:
    """Retrieve ``spec``'s chunks from the one holding ``spec.first_token`` into ``sink`` (absolute token
    positions); returns the end of the verified run from token 0 (the chunks before the first read count as
    present: vLLM holds them). Only the chunks read count as hits in kvtier's metrics; the tiers' eviction order
    learns the whole chain, the chunks not read included (a chain's root must not leave before its tail). A spec
    with a ``tail_nonce`` (a disaggregated decode) reads the whole blocks of the prompt's partial last chunk up to
    ``spec.end`` after its full chunks (kvtier.integrations.vllm.transfer): the verified end is then ``spec.end``."""
    tokens, size = unpack_tokens(spec.tokens), cache.chunk_size
    skip = spec.first_token // size
    if spec.tail_nonce:  # vLLM allocated blocks up to ``end`` only, which need not end a chunk
        sink = _Clipped(sink, spec.end)
    extras = unpack_extras(spec.extras)
    chain = cache.keys(tokens, salt=spec.salt, extras=extras)
    if spec.window_block_ids:
        return _retrieve_windowed(cache, chain, tokens, skip, sink)
    keys = chain[skip:]
    good = 0
    if keys:
        good = cache.retrieve_keyed(keys, tokens[skip * size : (skip + len(keys)) * size],
                                    _Shifted(sink, skip * size))
    if skip and good:  # the request used its whole chain: its root must not leave a tier before the chunks read
        cache.chain.order_chain(chain[: skip + good])
    got = (skip + good) * size
    if spec.tail_nonce and skip + good == len(chain) and got < spec.end:  # a disaggregated decode's tail
        parent = chain[-1] if chain else None
        if load_tail(cache, tokens[got : spec.end], got, parent, spec.salt, extras, spec.tail_nonce, sink):
            return spec.end
    return got


def _retrieve_windowed(cache: KVCache, chain: list, tokens, skip: int, sink) -> int:
    """A load with sliding-window groups: all or nothing at the boundary that ends ``chain``. Its window (or
    Mamba state) snapshot first (a miss or a corrupt one: nothing beyond vLLM's own hit is loaded), then the
    full-attention chunks from ``skip`` on, then the snapshot into its blocks (``sink.write_states``). Returns as
    ``retrieve_spec`` does."""
    size, boundary = cache.chunk_size, len(chain)
    snapshot = cache.retrieve_snapshot(chain, boundary, tokens)
    if snapshot is None:
        return skip * size
    good = boundary - skip
    if cache.spec is not None:  # a model whose every layer slides has no full-attention chunks
        good = cache.retrieve_keyed(chain[skip:], tokens[skip * size : boundary * size], _Shifted(sink, skip * size))
    if skip + good < boundary:
        return (skip + good) * size
    sink.write_states(boundary * size, snapshot)
    if skip and cache.spec is not None:
        cache.chain.order_chain(chain)
    return boundary * size


@dataclass
class _Load:
    """One request's load: its sink, guarded so it can be closed from another thread."""

    spec: LoadSpec
    sink: PagedSink
    chunk_size: int
    deadline: float
    late_at: float = float("inf")  # a quarter of the way to the deadline: a niced load this slow is starved
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    reason: str = ""
    written: set[int] = field(default_factory=set)  # start tokens of the chunks written
    windows: StateGroups | None = None  # the snapshot groups (loads with window_block_ids)

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        with self.lock:
            if self.closed:
                raise _Closed(self.spec.req_id)  # vLLM may own these blocks again
            self.sink.write(start, end, chunk)
            self.written.add(start)

    def settle(self) -> None:
        self.sink.settle()

    def write_states(self, boundary: int, states: dict[StateKind, torch.Tensor]) -> None:
        with self.lock:
            if self.closed or self.windows is None:
                raise _Closed(self.spec.req_id)
            self.windows.restore_states(self.spec.window_block_ids, boundary, self.spec.first_token, self.spec.end,
                                        states)

    def close(self, reason: str) -> bool:
        """Stop writes; False if it was closed already (then someone else reports it)."""
        with self.lock:
            if self.closed:
                return False
            self.closed, self.reason = True, reason
            return True

    def written_prefix(self) -> int:
        """Tokens from 0 covered by vLLM's own hit and the written chunks after it, without a gap."""
        end = self.spec.first_token - self.spec.first_token % self.chunk_size
        while end in self.written:
            end += self.chunk_size
        return end


class AsyncLoads:
    """This rank's asynchronous loads: ``submit`` from ``start_load_kv``, ``finished`` from ``get_finished``."""

    def __init__(self, paged: PagedKV, cache: KVCache, default_timeout_s: float, *, nice: int = 0,
                 windows: StateGroups | None = None) -> None:
        """``nice``: the loading thread's niceness (Linux, per thread); threads it starts inherit it. The first
        load still running a quarter of the way to its deadline ends the niceness (``_unnice``). ``windows``: the
        sliding-window groups, for loads that restore them."""
        self.paged, self.cache, self.windows = paged, cache, windows
        self.failed: set[str] = set()  #: loads with window groups that fell short (reported per request)
        self.default_timeout_s, self.nice = default_timeout_s, nice
        self._queue: queue.Queue[_Load | None] = queue.Queue()
        self._active: dict[str, _Load] = {}  # submitted, not reported yet (main thread only)
        self._lock = threading.Lock()  # guards _done and _counts, shared with the loading thread
        self._done: list[tuple[_Load, int]] = []  # (load, verified tokens from 0) finished by the thread
        self._counts: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()  #: loads reported since the start, by how they ended
        self._thread = WATCHED.watch(threading.Thread(target=self._run, name="kvtier-load", daemon=True))
        self._thread.start()

    def submit(self, spec: LoadSpec) -> None:
        timeout = spec.timeout_s if spec.timeout_s is not None else self.default_timeout_s
        now = time.monotonic()
        load = _Load(spec, PagedSink(self.paged, spec.block_ids, spec.first_token), self.cache.chunk_size,
                     now + timeout, now + timeout / 4, windows=self.windows)
        self._active[spec.req_id] = load
        self._queue.put(load)

    def _run(self) -> None:
        name_os_thread("kvtier-load")
        if self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (OSError, AttributeError) as exc:  # not Linux, or not allowed: load at the usual priority
                log.info("kvtier: loading thread keeps its priority (%s)", exc)
        # vLLM's KV tensors are inference tensors: only code in inference mode may write them (per thread)
        with torch.inference_mode():
            while (load := self._queue.get()) is not None:
                if load.closed:
                    continue  # past its deadline or cancelled while queued: reported already
                got = 0
                try:
                    got = retrieve_spec(self.cache, load.spec, load)
                except Exception as exc:  # a bug or a sink error: what did not arrive is recomputed
                    if load.closed or _interpreter_exiting(exc):  # reported already, or the process is ending
                        log.debug("kvtier: closed load of request %s ended in an error", load.spec.req_id)
                    else:
                        log.exception("kvtier: loading request %s failed", load.spec.req_id)
                self.paged.synchronize()
                if load.close("done"):
                    with self._lock:
                        self._done.append((load, got))

    def finished(self, finished_req_ids: set[str] | None = None) -> tuple[set[str], set[int]]:
        """Loads over since the last call, and their blocks that did not arrive verified.

        Loads past their deadline and loads of requests in ``finished_req_ids`` (vLLM finished them while they
        loaded: aborted) are closed and reported here too."""
        now = time.monotonic()
        if self.nice and any(now > load.late_at for load in self._active.values()):
            self._unnice()
        closed = []
        for req_id, load in self._active.items():
            reason = "aborted" if finished_req_ids and req_id in finished_req_ids else (
                "deadline" if now > load.deadline else "")
            if reason and load.close(reason):
                closed.append(load)
        if closed:
            self.paged.synchronize()  # writes queued before the close have landed
        with self._lock:
            done, self._done = self._done, []
        results = done + [(load, load.written_prefix()) for load in closed]
        req_ids, bad = set(), set()
        for load, got in results:
            req_ids.add(load.spec.req_id)
            self._active.pop(load.spec.req_id, None)
            bad.update(self._account(load, got))
        return req_ids, bad

    def _account(self, load: _Load, got: int) -> list[int]:
        spec, bs = load.spec, self.paged.block_size
        loaded = max(min(got, spec.end) - spec.first_token, 0)
        bad = spec.block_ids[max(got, spec.first_token) // bs : -(-spec.end // bs)] if got < spec.end else []
        failed = bool(spec.window_block_ids) and got < spec.end
        if failed:  # block ids are unique only within a group: vLLM takes a failed request and recomputes it all
            self.failed.add(spec.req_id)
            loaded, bad = 0, []
        with self._lock:
            self._counts.update(loaded_tokens=loaded, failed_blocks=len(bad),
                                expired_loads=int(load.reason == "deadline"), failed_loads=int(failed))
            self.totals.update([load.reason], loaded_tokens=loaded, failed_blocks=len(bad))
        if failed and load.reason != "aborted":
            log.warning("kvtier: request %s: its window snapshot or chunks did not arrive verified (%s); vLLM "
                        "recomputes it", spec.req_id, load.reason)
        if bad and load.reason != "aborted":
            log.warning("kvtier: request %s got %d of %d promised tokens (%s); %d blocks will be recomputed",
                        spec.req_id, loaded, spec.end - spec.first_token, load.reason, len(bad))
        return bad

    def _unnice(self) -> None:
        """A niced load ran late (other processes take the cores): every thread at the loader's niceness (the
        loading thread and those it started; nothing else in the process sets it) goes back to this thread's
        priority for good, where the OS allows it (root or CAP_SYS_NICE); else they stay niced."""
        nice, self.nice = self.nice, 0
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        try:
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()  # after the thread's name: state, ppid, ...
                if int(fields[16]) == nice:  # field 19 of stat: the niceness
                    os.setpriority(os.PRIO_PROCESS, int(tid), mine)
            log.info("kvtier: a load ran late at niceness %d; loading threads back at the engine's priority", nice)
        except OSError as exc:  # not Linux, or not allowed to lower a niceness: loads stay niced
            log.info("kvtier: a load ran late at niceness %d and its threads stay niced (%s)", nice, exc)

    def take_counts(self) -> Counter[str]:
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return counts

    def close(self) -> None:
        """Close every load (none writes into vLLM's blocks after this returns) and stop the thread."""
        for load in self._active.values():
            load.close("shutdown")
        self._queue.put(None)
        WATCHED.unwatch(self._thread)
        self._thread.join(timeout=5)  # a retrieve stuck in a tier cannot write anymore: do not wait for it
        self.paged.synchronize()
        self._active.clear()


def _interpreter_exiting(exc: BaseException) -> bool:
    """Whether ``exc`` only says the engine is going away: it quit while a load ran, and a tier's thread pool,
    shut down by the cache's close or by Python's exit, refuses work (``concurrent.futures`` raises this
    RuntimeError, "cannot schedule new futures after [interpreter] shutdown", for both)."""
    return sys.is_finalizing() or (isinstance(exc, RuntimeError) and "cannot schedule new futures" in str(exc))
