"""Worker side of the connector: owns this rank's KVCache, loads before the forward pass, saves after it.

* Loads run synchronously in ``start_load_kv`` (vLLM schedules them as sync loads, so the forward pass that
  needs them has not started). ``KVCache.retrieve`` verifies every chunk; whatever of a promised range does
  not arrive intact (evicted since the lookup, corrupt, tier down) is reported block by block through
  ``load_errors`` and vLLM recomputes it. Nothing unverified is ever left for vLLM to use.
* Saves run on one background thread, off the forward path: vLLM keeps a finished request's blocks until
  ``finished_saves`` returns its id, so the thread reads stable blocks while later steps run.
* A :class:`LookupServer` answers the scheduler's lookups against this rank's cache.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Iterable

from kvtier.core.cache import KVCache
from kvtier.integrations.vllm.lookup import LookupLimits, LookupServer
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec, unpack_tokens
from kvtier.integrations.vllm.paged import PagedKV, PagedSink, PagedSource

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, paged: PagedKV, cache: KVCache, socket_path: str, max_lookup_tokens: int) -> None:
        self.paged, self.cache = paged, cache
        self.block_size = paged.block_size
        self._failed: set[int] = set()
        self._done: set[str] = set()
        self._lock = threading.Lock()  # guards _done and _counts, shared with the saving thread
        self._counts: Counter[str] = Counter()
        self._jobs: queue.Queue[SaveSpec | None] = queue.Queue()
        self._saver = threading.Thread(target=self._save_loop, name="kvtier-save", daemon=True)
        self._saver.start()
        self.server = LookupServer(cache, socket_path, LookupLimits(max_tokens=max_lookup_tokens))

    # -- loads ---------------------------------------------------------------------------------------------
    def load(self, meta: KVTierMetadata) -> None:
        for spec in meta.loads:
            self._load_one(spec)
        self.paged.synchronize()

    def _load_one(self, spec: LoadSpec) -> None:
        tokens = unpack_tokens(spec.tokens)
        sink = PagedSink(self.paged, spec.block_ids, spec.first_token)
        _, got = self.cache.retrieve(tokens, sink, salt=spec.salt, max_tokens=len(tokens))
        loaded = max(min(got, spec.end) - spec.first_token, 0)
        bs = self.block_size
        bad = spec.block_ids[max(got, spec.first_token) // bs : -(-spec.end // bs)] if got < spec.end else []
        with self._lock:
            self._counts.update(loaded_tokens=loaded, failed_blocks=len(bad))
        if not bad:
            return
        log.warning("kvtier: request %s got %d of %d promised tokens; %d blocks will be recomputed",
                    spec.req_id, max(got - spec.first_token, 0), spec.end - spec.first_token, len(bad))
        self._failed.update(bad)

    def load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    # -- saves ---------------------------------------------------------------------------------------------
    def submit_saves(self, saves: Iterable[SaveSpec]) -> None:
        for spec in saves:
            self._jobs.put(spec)

    def _save_loop(self) -> None:
        while (spec := self._jobs.get()) is not None:
            stored = 0
            try:
                stored = self.cache.store(unpack_tokens(spec.tokens), PagedSource(self.paged, spec.block_ids),
                                          salt=spec.salt)
            except Exception:  # a bug must not keep vLLM's blocks forever: log it, report the save done
                log.exception("kvtier: saving request %s failed", spec.req_id)
            with self._lock:
                self._done.add(spec.req_id)
                self._counts.update(stored_tokens=stored, saved_requests=1)

    def finished_saves(self) -> set[str]:
        with self._lock:
            done, self._done = self._done, set()
        return done

    def take_counts(self) -> dict[str, int]:
        """Counters since the last call (loaded_tokens, failed_blocks, stored_tokens, saved_requests)."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return dict(counts)

    def close(self) -> None:
        self._jobs.put(None)
        self._saver.join(timeout=30)
        self.server.close()
        self.cache.close()
