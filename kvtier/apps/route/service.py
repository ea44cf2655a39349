"""The routing service: for each request, hash its prompt, ask the index and the policy, proxy it, account.

``Router.route`` is the whole life of one generation request after its body was read:

1. parse it (kvtier.apps.route.requests: a 4xx for what no replica could serve) and take an admission slot (429
   when the queue is full);
2. tokenize the prompt as the replicas do (its first ``max_prompt_tokens`` at most, on a worker thread: the
   chunks that say where it is cached; whether all of it fits is its replica's call) and hash its chunks in
   each replica's namespace (with the caller's tenant salt), look the keys up in the index, and let the
   policy (kvtier.fleet.scoring) pick among the replicas that are up, by cost and load;
3. forward it (kvtier.apps.route.proxy); a failure before the first byte reached the client (the replica's
   ejection while the request waits on it included) is retried on another replica, up to ``max_attempts`` replicas;
4. account: the replica's load ticket, the index's record of what was sent where, the session's replica,
   and the metrics (routed requests by replica and reason, expected vs reported cached tokens, retries).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import zmq.asyncio
from starlette.responses import JSONResponse, Response

from kvtier.api.errors import error_body
from kvtier.apps.route.admission import Admission, Slot
from kvtier.apps.route.config import RouterConfig, SessionPlacement
from kvtier.apps.route.health import Health
from kvtier.apps.route.metrics import (
    BROKEN_STREAMS,
    DECODE_STREAMS,
    EVENTS,
    EXPECTED_CACHED,
    IN_FLIGHT,
    INDEX_CHUNKS,
    INDEX_DROPPED_EVENTS,
    PREFILL_TOKENS,
    QUEUE_WAITING,
    REJECTED,
    REPLICA_UP,
    REPORTED_CACHED,
    RETRIES,
    ROUTED,
    STICKY_BREAKS,
    TOKENIZE_SECONDS,
)
from kvtier.apps.route.proxy import Hooks, Retryable, forward, upstream_headers
from kvtier.apps.route.replicas import Replica, Ticket, record_namespace
from kvtier.apps.route.requests import ParsedRequest, Prompt
from kvtier.base.keys import ChunkHash, Namespace
from kvtier.base.metrics import Metrics
from kvtier.events.keys import default_key_file, load_or_create
from kvtier.events.subscriber import SubscriberConfig
from kvtier.fleet.draws import prompt_digest
from kvtier.fleet.index import FleetIndex
from kvtier.fleet.scoring import Reason, RouteRequest, StickySessions, TieBreak
from kvtier.fleet.sessions import RendezvousSessions

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """What the router needs of a tokenizer (kvtier.integrations.prompts.PromptTokenizer)."""

    def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None,
             cut: bool = False) -> list[int] | None: ...

    def text(self, prompt: str, max_tokens: int | None = None) -> list[int]: ...


@dataclass(frozen=True)
class Plan:
    """Where one attempt goes and what the router expects there."""

    replica: Replica
    reason: Reason
    keys: list[ChunkHash]
    expected_cached: int
    #: this router's decisions so far, this one included (``x-kvtier-decision``: the order it placed requests in)
    decision: int = 0


def _policy(config: RouterConfig):
    routing = config.routing
    if config.sessions is SessionPlacement.RENDEZVOUS and routing.sticky:
        inner = dataclasses.replace(routing, sticky=False).build()
        return RendezvousSessions(inner, routing.epsilon, routing.load_floor)
    return routing.build()


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, metrics: Metrics | None = None, *,
                 gauges: bool = True) -> None:
        """``gauges``: register ``replica_gauges`` with ``metrics`` (off for a pool whose owner reports them)."""
        self.config, self.tokenizer = config, tokenizer
        self.metrics = metrics if metrics is not None else Metrics()
        self.replicas = [Replica(entry, config.proxy) for entry in config.replicas]
        self.decisions = 0  #: routing decisions made (every attempt's), numbering ``Plan.decision``
        idx = config.index
        self.index = FleetIndex(recent_ttl_s=idx.recent_ttl_s, in_flight_ttl_s=idx.in_flight_ttl_s,
                                shared_ttl_s=idx.shared_ttl_s, replicas=len(self.replicas))
        self.record = record_namespace(idx.chunk_size)
        self.policy = _policy(config)
        self.health = Health(self.replicas, config.health, self.metrics, self._follow)
        self.admission: Admission | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self.events_key: tuple[bytes, bytes] | None = None  #: (public, secret) Z85: what replicas must allow
        self._tasks: list[asyncio.Task] = []
        if gauges:
            self.metrics.add_gauges(self.replica_gauges)

    async def start(self) -> None:
        """Probe every replica once (their info and events), then keep probing in the background."""
        self._zmq = zmq.asyncio.Context()
        self.events_key = load_or_create(self.config.events_key or default_key_file())
        self.admission = Admission(self.config.admission)
        await self.health.probe_all()
        self._tasks.append(asyncio.ensure_future(self.health.run()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in self.replicas:
            await replica.close()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)

    def _follow(self, replica: Replica) -> None:
        assert self._zmq is not None
        count = lambda what: self.metrics.inc(EVENTS, replica=replica.name, what=what)
        replica.follow_events(self._zmq, self.index, SubscriberConfig(resync_s=self.config.index.resync_s), count,
                              self.events_key)

    # -- one request -----------------------------------------------------------------------------------------
    async def route(self, path: str, parsed: ParsedRequest, body: bytes,
                    headers: list[tuple[bytes, bytes]]) -> Response:
        """Serve one parsed generation request: admit it (Overloaded when the queue is full), then route it.
        ``headers`` are the client's, as raw bytes (passed on as they came)."""
        assert self.admission is not None
        slot = await self.admission.admit()
        try:
            started = time.perf_counter()
            ids = await self._prompt_ids(parsed.prompt)
            self.metrics.observe(TOKENIZE_SECONDS, time.perf_counter() - started)
            return await self._attempts(path, parsed, ids, body, upstream_headers(headers), slot)
        except BaseException:
            slot.release()
            raise

    async def _attempts(self, path: str, parsed: ParsedRequest, ids: list[int] | None, body: bytes,
                        headers: list[tuple[bytes, bytes]], slot: Slot) -> Response:
        tried: set[str] = set()
        last: Retryable | None = None
        draw = self._draw_key(parsed.prompt)
        for _ in range(self.config.proxy.max_attempts):
            plan = self.plan(ids, parsed, tried, draw)
            if plan is None:
                break
            tried.add(plan.replica.name)
            try:
                return await self._attempt(path, parsed, plan, len(ids or ()), body, headers, slot)
            except Retryable as exc:
                last = exc
        slot.release()
        if last is not None and last.response is not None:
            return last.response
        status = 502 if last is not None else 503
        message = "no replica could serve the request" if last is not None else "no replica is up"
        self.metrics.inc(REJECTED, reason="no_replica")
        return JSONResponse(error_body(message, status), status_code=status,
                            headers={"Retry-After": str(self.config.admission.retry_after_s)})

    async def _attempt(self, path: str, parsed: ParsedRequest, plan: Plan, prompt_tokens: int, body: bytes,
                       headers: list[tuple[bytes, bytes]], slot: Slot) -> Response:
        replica = plan.replica
        self.metrics.inc(ROUTED, replica=replica.name, reason=plan.reason.value)
        if plan.reason is Reason.STICKY_BREAK:
            self.metrics.inc(STICKY_BREAKS)
        self.index.record(replica.name, plan.keys)
        ticket = Ticket(replica, max(prompt_tokens - plan.expected_cached, 0))

        def finished(cached: int | None, ok: bool) -> None:
            ticket.done()
            slot.release()
            if cached is not None:
                self.metrics.inc(EXPECTED_CACHED, plan.expected_cached,
                                 replica=replica.name)
                self.metrics.inc(REPORTED_CACHED, cached, replica=replica.name)
            if not ok:
                self.metrics.inc(BROKEN_STREAMS, replica=replica.name)

        try:
            response = await forward(replica, path, body, headers, Hooks(ticket.decoding, finished))
        except Retryable as exc:
            ticket.done()
            busy = exc.response is not None and exc.response.status_code == 429
            if not busy:
                self.health.request_failed(replica)
            self.metrics.inc(RETRIES, replica=replica.name, cause="busy" if busy else "failed")
            log.info("replica %s failed a request before answering (%s); trying another", replica.name, exc.cause)
            raise
        except BaseException:  # the client went away (cancelled) or a bug: the replica's share is returned
            ticket.done()
            raise
        self.health.request_ok(replica)
        response.headers["x-kvtier-decision"] = str(plan.decision)
        if parsed.session is not None and isinstance(self.policy, StickySessions):
            self.policy.remember(parsed.session, replica.name)
        return response

    def plan(self, ids: list[int] | None, parsed: ParsedRequest, exclude: set[str], draw: bytes = b"") -> Plan | None:
        """The policy's choice among the replicas that are up and not in ``exclude`` (``draw``: what a random
        tie-break draws from, ``_draw_key``); None if there are none."""
        candidates = [r for r in self.replicas if r.up and r.name not in exclude]
        if not candidates:
            return None
        keys_of: dict[bytes, list[ChunkHash]] = {}
        record_keys = self._keys(self.record, ids, parsed.salt, keys_of)
        keys, cached = [], []
        for replica in candidates:
            namespace = replica.namespace(self.record)
            salt = parsed.salt if replica.salted else b""
            replica_keys = self._keys(namespace, ids, salt, keys_of) if namespace is not None else []
            chunks = self.index.cached(replica.name, replica_keys)
            keys.append(replica_keys)
            cached.append({tier: n * namespace.chunk_size for tier, n in chunks.items()} if namespace else {})
        views = [replica.view(c) for replica, c in zip(candidates, cached)]
        first = next((k[0] for k in keys if k), record_keys[0] if record_keys else b"")  # a new prefix's home
        request = RouteRequest(len(ids or ()), first, parsed.session, draw)
        decision = self.policy.decide(request, views)
        i = decision.replica
        namespace = candidates[i].namespace(self.record)
        # a replica computes at least the prompt's last token, so it uses no more than the chunks before it
        usable = (len(ids or ()) - 1) // namespace.chunk_size * namespace.chunk_size if namespace else 0
        self.decisions += 1
        return Plan(candidates[i], decision.reason, keys[i], min(sum(cached[i].values()), max(usable, 0)),
                    self.decisions)

    @staticmethod
    def _keys(namespace: Namespace, ids: list[int] | None, salt: bytes,
              memo: dict[bytes, list[ChunkHash]]) -> list[ChunkHash]:
        if not ids:
            return []
        salted = namespace.with_salt(salt)
        root = bytes(salted.root)
        if root not in memo:
            memo[root] = salted.chunk_hashes(ids)
        return memo[root]

    def _draw_key(self, prompt: Prompt) -> bytes:
        """The prompt's digest for a random tie-break (kvtier.fleet.draws); b"" with the stable home, which never
        reads it, and for a prompt cut short."""
        if self.config.routing.tie_break is not TieBreak.RANDOM or prompt.cut:
            return b""
        return prompt_digest(messages=prompt.messages, text=prompt.text, ids=prompt.ids)

    async def _prompt_ids(self, prompt: Prompt) -> list[int] | None:
        """The prompt's leading token ids (``max_prompt_tokens`` or a few more) as the replicas compute them, off
        the event loop; None if unknowable."""
        limit = self.config.proxy.max_prompt_tokens
        if prompt.ids is not None:
            return prompt.ids[:limit]
        if prompt.text is not None:
            return await asyncio.to_thread(self.tokenizer.text, prompt.text, limit)
        if prompt.messages is not None:
            return await asyncio.to_thread(self.tokenizer.chat, prompt.messages, limit, prompt.cut)
        return None

    def replica_gauges(self):
        """``(name, labels, value)`` of every replica's gauges and of the admission queue's."""
        for replica in self.replicas:
            labels = {"replica": replica.name}
            yield REPLICA_UP.name, labels, float(replica.up)
            yield IN_FLIGHT.name, labels, float(replica.in_flight)
            yield PREFILL_TOKENS.name, labels, float(replica.prefill_tokens)
            yield DECODE_STREAMS.name, labels, float(replica.decode_streams)
            for tier, chunks in self.index.chunks(replica.name).items():
                yield INDEX_CHUNKS.name, {"replica": replica.name, "tier": tier}, float(chunks)
            yield INDEX_DROPPED_EVENTS.name, labels, float(self.index.dropped(replica.name))
        if self.admission is not None:
            yield QUEUE_WAITING.name, {}, float(self.admission.waiting)
