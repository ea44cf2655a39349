"""The scheduler's lookups, off vLLM's scheduling loop: one per waiting request, asked on a thread of its own.

* A request's lookup is asked when vLLM adds the request (``ask``), so it usually has its answer by the time
  vLLM first tries to schedule it. ``answer`` waits for it at most until ``timeout_s`` after it was asked;
  past that deadline the answer is a miss (0 tokens), and stays one until the entry is refreshed.
* The answer is kept until the request's tokens change (a preempted request comes back with its output
  appended) or the cache changes (``changed``: a save finished, a load found chunks gone); a stale entry is
  asked again, under the same deadline, when vLLM next tries to schedule the request. An answer that is too
  high (chunks evicted since) costs load errors that vLLM recomputes, never a wrong output.
* ``forget`` drops a request's entry (vLLM scheduled or finished it).

The lookup client is used by the lookup thread only (its connections are not shared between threads).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.base.keys import NO_EXTRAS, ExtraKeys
from kvtier.integrations.vllm.lookup import LookupClient
from kvtier.integrations.vllm.threads import name_os_thread

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    n_tokens: int
    generation: int
    deadline: float
    result: int | None = None
    expired: bool = False  # not answered by its deadline: a miss, whatever arrives later
    ready: threading.Event = field(default_factory=threading.Event)


class Lookups:
    def __init__(self, client: LookupClient, timeout_s: float) -> None:
        self.client, self.timeout_s = client, timeout_s
        self.generation = 0
        self._entries: dict[str, _Entry] = {}
        self._queue: queue.Queue[tuple[_Entry, list[int], bytes, ExtraKeys] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvtier-lookups", daemon=True)
        self._thread.start()
        self.asked = 0  #: lookups sent to the workers (for tests and stats)
        self.expired = 0  #: answers given as misses because the lookup was late

    def changed(self) -> None:
        """The cache gained or lost chunks: every entry is refreshed when next needed."""
        self.generation += 1

    def ask(self, req_id: str, tokens: Sequence[int], salt: bytes, extras: ExtraKeys = NO_EXTRAS) -> None:
        """Start the request's lookup unless an entry for these tokens and this cache is under way or known."""
        entry = self._entries.get(req_id)
        if entry is not None and entry.n_tokens == len(tokens) and entry.generation == self.generation:
            return
        new = _Entry(len(tokens), self.generation, time.monotonic() + self.timeout_s)
        self._entries[req_id] = new
        self.asked += 1
        self._queue.put((new, list(tokens), salt, extras))

    def answer(self, req_id: str, tokens: Sequence[int], salt: bytes, extras: ExtraKeys = NO_EXTRAS) -> int:
        """Tokens kvtier holds of ``tokens`` (whole chunks), by the rules of the module docstring."""
        self.ask(req_id, tokens, salt, extras)
        entry = self._entries[req_id]
        if entry.expired:
            return 0
        if entry.ready.wait(max(entry.deadline - time.monotonic(), 0.0)):
            return entry.result or 0
        self.expired += 1
        log.warning("kvtier: lookup of request %s not answered within %.2f s: a miss", req_id, self.timeout_s)
        entry.expired = True
        return 0

    def forget(self, req_id: str) -> None:
        self._entries.pop(req_id, None)

    def _run(self) -> None:
        name_os_thread("kvtier-lookups")
        while (job := self._queue.get()) is not None:
            entry, tokens, salt, extras = job
            try:
                entry.result = self.client.lookup(tokens, salt, extras)
            except Exception:  # LookupClient turns socket failures into misses; anything else is a bug
                log.exception("kvtier: lookup failed")
                entry.result = 0
            entry.ready.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self.client.close()
