"""The model side of the server: one worker thread runs one generation at a time, fed by a bounded queue.

``Engine.submit`` never blocks: a job is either queued (at most ``max_queue`` waiting besides the one
running) or refused at once with ``Overloaded``, so an overloaded server answers 429 instead of hanging.
Tokens travel from the worker thread to the request's event loop through ``loop.call_soon_threadsafe``;
a job whose client went away is cancelled and stops at its next token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvtier.apps.serve.metrics import QUEUE_LIMIT, QUEUE_SECONDS, REQUESTS_IN_FLIGHT
from kvtier.base.metrics import Metrics
from kvtier.base.threads import WATCHED
from kvtier.integrations.sampling import GREEDY, SamplingParams
from kvtier.integrations.transformers import GenerationStats, PrefixCachedLM, Span

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The queue is full; the caller should answer 429 and let the client retry."""


class EngineDown(Exception):
    """The worker thread is gone (``/health`` names it): the caller should answer 503."""


class EventKind(Enum):
    TOKEN = "token"
    DONE = "done"
    ERROR = "error"


@dataclass(frozen=True)
class Event:
    kind: EventKind
    token: int = 0
    error: str = ""


@dataclass
class Job:
    """One generation request. ``events`` receives TOKEN events, then exactly one DONE or ERROR."""

    prompt_ids: list[int]
    max_tokens: int
    salt: bytes
    stop_ids: Sequence[int]
    loop: asyncio.AbstractEventLoop
    sampling: SamplingParams = GREEDY
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float = 0.0
    finish: str | None = None  #: set by the consumer: "stop" or "length"; None if generation failed
    error: str = ""
    segments: tuple[Span, ...] = ()  #: token spans of reusable passages (used when the server blends)
    ttl_s: float | None = None  #: the stored prompt KV's retention time (the request's ``cache_ttl_s``)

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """Owns the model: a PrefixCachedLM driven by a single worker thread."""

    def __init__(self, lm: PrefixCachedLM, metrics: Metrics, max_queue: int = 16) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.lm = lm
        self.metrics = metrics
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._max_pending = max_queue + 1  # the running job plus the waiting ones
        self._pending = 0
        self._thread = WATCHED.watch(threading.Thread(target=self._run, name="kvtier-engine", daemon=True))
        self._thread.start()
        metrics.add_gauges(self._gauges)

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return self._pending

    def submit(self, job: Job) -> None:
        """Queue ``job`` or raise Overloaded at once (also once the worker thread is gone: nothing would run it)."""
        if not self._thread.is_alive():
            raise EngineDown(f"the engine thread {self._thread.name} is not running")
        with self._lock:
            if self._pending >= self._max_pending:
                raise Overloaded(f"{self._pending} requests in flight (limit {self._max_pending})")
            self._pending += 1
        self._jobs.put(job)

    def close(self) -> None:
        """Stop the worker after the job it is running (queued jobs are cancelled)."""
        WATCHED.unwatch(self._thread)
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        """The worker: one job at a time. Whatever one job raises fails that job alone (an ERROR event) and the
        next is served; should the loop itself die, the jobs queued are failed, not left waiting for ever."""
        job = None
        try:
            while (job := self._jobs.get()) is not None:
                try:
                    self._generate(job)
                except Exception as exc:  # a bug beyond the model's own errors: this job fails, the thread goes on
                    log.exception("generation failed")
                    job.emit(Event(EventKind.ERROR, error=f"{type(exc).__name__}: {exc}"))
                finally:
                    with self._lock:
                        self._pending -= 1
        finally:
            if job is not None:  # the loop itself died, during this job
                log.error("the engine thread %s died; /health reports it", self._thread.name)
                job.emit(Event(EventKind.ERROR, error="the engine thread died"))
            self._drain()

    def _generate(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.emit(Event(EventKind.ERROR, error="cancelled before it started"))
            return
        job.started_at = time.perf_counter()
        self.metrics.observe(QUEUE_SECONDS, job.started_at - job.queued_at)
        try:
            for token in self.lm.stream(job.prompt_ids, job.max_tokens, salt=job.salt, stop_ids=job.stop_ids,
                                        stats=job.stats, sampling=job.sampling, segments=job.segments,
                                        ttl_s=job.ttl_s):
                job.emit(Event(EventKind.TOKEN, token=token))
                if job.cancelled.is_set():
                    break
        except (RuntimeError, ValueError, IndexError) as exc:  # model errors (e.g. too long a prompt)
            log.warning("generation failed: %s", exc)
            job.emit(Event(EventKind.ERROR, error=str(exc)))
            return
        job.emit(Event(EventKind.DONE))

    def _drain(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit(Event(EventKind.ERROR, error="server shutting down"))

    def _gauges(self):
        yield REQUESTS_IN_FLIGHT.name, {}, float(self.pending)
        yield QUEUE_LIMIT.name, {}, float(self._max_pending)
