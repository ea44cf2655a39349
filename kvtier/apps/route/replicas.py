"""The router's replicas: what each is (``/kvtier/info``), whether it is up, and its load by the router's count.

Load is the router's own accounting, never the replica's word: a ``Ticket`` per proxied request adds the
prompt tokens the replica has to compute to ``prefill_tokens`` until its first text comes back, then counts
it as a decode stream until it ends. ``in_flight`` counts both (the load bound's measure).

A replica that publishes cache events (kvtier serve) gets an ``EventSubscriber`` feeding the router's index;
it is started when the replica is admitted, restarted when its ``/kvtier/info`` names new endpoints or a new
key (it restarted), and stopped when the replica is ejected, which also frees what the index knew of it. The
subscription expects the CURVE public key the replica's ``/kvtier/info`` names: a replica that names none
(an older kvtier) is not followed, and the router's own record stands in for its events.

A vLLM replica whose entry names its KV events (``ReplicaEntry.vllm_events``) gets a ``VllmEventSubscriber``
instead (kvtier.apps.route.vllm_events), feeding a ``VllmReplicaIndex`` (kvtier.fleet.vllm_index); its keys are
the router's keys of its blocks, never salted (vLLM's events carry no tenant the router could hash).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq.asyncio

from kvtier.apps.route.config import ProxyConfig, ReplicaEntry
from kvtier.apps.route.upstream import Upstream
from kvtier.apps.route.vllm_events import VllmEventSubscriber, VllmSubscriberConfig
from kvtier.base.keys import Namespace
from kvtier.base.layout import KVSpec
from kvtier.events.subscriber import EventSubscriber, SubscriberConfig
from kvtier.events.wire import Batch, SnapshotHead, WireError, namespace_from_json
from kvtier.fleet.index import FleetIndex, PreparedSnapshot
from kvtier.fleet.scoring import ReplicaView
from kvtier.fleet.vllm_index import SHARED_MEDIUM, VllmReplicaIndex, vllm_namespace
from kvtier.web.http_limits import CLIENT_KEEPALIVE_S

if TYPE_CHECKING:
    from starlette.responses import Response

log = logging.getLogger(__name__)
T = TypeVar("T")


class Retryable(Exception):
    """The replica failed before anything reached the client (or was ejected while the request waited on it);
    ``response`` is its answer, if it gave one. proxy.py raises it too, and re-exports it."""

    def __init__(self, cause: str, response: Response | None = None) -> None:
        super().__init__(cause)
        self.cause, self.response = cause, response

#: The namespace of the router's own record for replicas that publish nothing (only compared with itself).
_RECORD_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8")


def record_namespace(chunk_size: int) -> Namespace:
    return Namespace("kvtier-route-record", _RECORD_SPEC, chunk_size)


class ReplicaState(enum.Enum):
    UP = "up"
    EJECTED = "ejected"


class _InfoEvents(msgspec.Struct, frozen=True):
    endpoint: str
    control: str
    epoch: str
    key: str = ""  #: the publisher's CURVE public key (Z85)


class _InfoJson(msgspec.Struct):
    kvtier: int
    cache: bool
    namespace: dict | None = None
    events: _InfoEvents | None = None


@dataclass(frozen=True)
class ReplicaInfo:
    """A kvtier replica's ``/kvtier/info``: its namespace (None: no cache) and event endpoints (None: none)."""

    namespace: Namespace | None
    events: _InfoEvents | None

    @classmethod
    def from_json(cls, body: bytes) -> ReplicaInfo:
        try:
            info = msgspec.json.decode(body, type=_InfoJson)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError(f"not a kvtier info: {exc}") from None
        namespace = namespace_from_json(info.namespace) if info.cache and info.namespace is not None else None
        return cls(namespace, info.events if namespace is not None else None)


class Ticket:
    """One request's share of a replica's load; ``decoding()`` once its first text arrived, ``done()`` at the
    end (both idempotent, so every exit path may call them)."""

    def __init__(self, replica: Replica, prefill_tokens: int) -> None:
        self.replica, self.prefill_tokens = replica, prefill_tokens
        self._decoding = self._done = False
        replica.in_flight += 1
        replica.prefill_tokens += prefill_tokens

    def decoding(self) -> None:
        if self._decoding or self._done:
            return
        self._decoding = True
        self.replica.prefill_tokens -= self.prefill_tokens
        self.replica.decode_streams += 1

    def done(self) -> None:
        if self._done:
            return
        self._done = True
        replica = self.replica
        replica.in_flight -= 1
        if self._decoding:
            replica.decode_streams -= 1
        else:
            replica.prefill_tokens -= self.prefill_tokens


class Replica:
    """One replica: its HTTP client (a bounded pool), state, load, info and event subscription."""

    def __init__(self, entry: ReplicaEntry | str, proxy: ProxyConfig) -> None:
        self.entry = entry if isinstance(entry, ReplicaEntry) else ReplicaEntry(entry)
        self.url = self.entry.url.rstrip("/")
        where = urlsplit(self.url)
        self.name = f"{where.hostname}:{where.port or (443 if where.scheme == 'https' else 80)}"
        timeout = httpx.Timeout(proxy.read_timeout_s, connect=proxy.connect_timeout_s, pool=proxy.read_timeout_s)
        limits = httpx.Limits(max_connections=proxy.max_connections, max_keepalive_connections=proxy.max_connections,
                              keepalive_expiry=CLIENT_KEEPALIVE_S)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits)  # health, admin
        self.upstream = Upstream(self.url, proxy.max_connections, proxy.connect_timeout_s, proxy.read_timeout_s,
                                 self.client)
        self.state = ReplicaState.UP
        self._ejected = asyncio.Event()  # set when ejected; a fresh one on readmission
        self.in_flight = self.prefill_tokens = self.decode_streams = 0
        self.failed_requests = self.failed_checks = self.good_checks = 0
        self.info: ReplicaInfo | None = None
        self._events: asyncio.Task | None = None
        self._events_from: _InfoEvents | None = None
        self._sink: _ReplicaSink | None = None
        self.vllm_index: VllmReplicaIndex | None = None

    @property
    def up(self) -> bool:
        return self.state is ReplicaState.UP

    def eject(self) -> None:
        """Take it out of routing; requests still waiting on it for their first byte are retried elsewhere."""
        self.state = ReplicaState.EJECTED
        self._ejected.set()

    def readmit(self) -> None:
        self.state, self._ejected = ReplicaState.UP, asyncio.Event()

    async def unless_ejected(self, work: Awaitable[T]) -> T:
        """``work``'s result, or Retryable once the replica is ejected first (``work`` is then cancelled)."""
        ejected = self._ejected
        if ejected.is_set():
            raise Retryable("the replica was ejected")
        task, watch = asyncio.ensure_future(work), asyncio.ensure_future(ejected.wait())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise Retryable("the replica was ejected while the request waited on it")
        return task.result()

    @property
    def salted(self) -> bool:
        """Whether its keys take the caller's tenant salt (a vLLM replica's events carry none the router knows)."""
        return self.entry.vllm_events is None

    def namespace(self, record: Namespace) -> Namespace | None:
        """The namespace its chunk keys are in: its own, the router's record's (no info), None (no cache); for a
        vLLM replica with events, the router's keys of its blocks (kvtier.fleet.vllm_index)."""
        if self.entry.vllm_events is not None:
            return vllm_namespace(self.entry.vllm_events.block_size)
        if self.info is None:
            return record
        return self.info.namespace

    def view(self, cached_tokens: dict[str, int]) -> ReplicaView:
        return ReplicaView(cached_tokens, float(self.in_flight), self.prefill_tokens, self.decode_streams,
                           self.name)

    # -- events ----------------------------------------------------------------------------------------------
    def follow_events(self, ctx: zmq.asyncio.Context, index: FleetIndex, config: SubscriberConfig,
                      count: Callable[[str], None], client_key: tuple[bytes, bytes] | None = None) -> None:
        """Subscribe to the events ``info`` names (again, if they changed since the last call), as the CURVE
        client ``client_key`` (the router's pair; None: the default one). A vLLM replica's events (its entry's
        ``vllm_events``) are followed from the first call until ``stop_events``."""
        if self.entry.vllm_events is not None:
            self._follow_vllm(ctx, index, config, count)
            return
        events = self.info.events if self.info is not None else None
        if self._events is not None and self._events.done() and not self._events.cancelled():
            log.error("replica %s: event subscription stopped: %r", self.name, self._events.exception())
        elif events == self._events_from and self._events is not None:
            return
        self.stop_events()
        self._events_from = events
        if events is None:
            return
        if len(events.key) != 40:
            log.warning("replica %s names no CURVE key for its events: not followed", self.name)
            return
        self._sink = _ReplicaSink(index, self.name)
        subscriber = EventSubscriber(ctx, events.endpoint, events.control, events.key.encode(), self._sink, config,
                                     count, client_key)
        self._events = asyncio.ensure_future(subscriber.run())

    def _follow_vllm(self, ctx: zmq.asyncio.Context, index: FleetIndex, config: SubscriberConfig,
                     count: Callable[[str], None]) -> None:
        if self._events is not None and not self._events.done():
            return
        if self._events is not None and not self._events.cancelled() and self._events.exception() is not None:
            log.error("replica %s: vLLM event subscription stopped: %r", self.name, self._events.exception())
        events = self.entry.vllm_events
        assert events is not None

        def counted(what: str) -> None:
            count(what)
            if what == "restart":  # what the router sent the old process says nothing of the new one
                index.restarted(self.name)

        shared = {SHARED_MEDIUM: events.shared} if events.shared is not None else None
        self.vllm_index = VllmReplicaIndex(index.holdings(self.name), events.block_size, events.media,
                                           shared=shared, count=count)
        paced = VllmSubscriberConfig(share=config.share, keys_per_turn=config.keys_per_turn)
        subscriber = VllmEventSubscriber(ctx, events.endpoint, events.replay, events.topic, self.vllm_index, paced,
                                         count=counted)
        self._events = asyncio.ensure_future(subscriber.run())
        self._sink = _ReplicaSink(index, self.name)  # frees the index when the replica is ejected

    def stop_events(self) -> None:
        """Stop following the replica's events and free what the index knew of it."""
        if self._events is not None:
            self._events.cancel()
            self._events = None
        if self._sink is not None:
            self._sink.forget()
            self._sink = None
        self._events_from = None

    async def close(self) -> None:
        self.stop_events()
        await self.client.aclose()
        await self.upstream.close()


class _ReplicaSink:
    """Feeds one replica's holdings; a new epoch (the replica restarted) also drops the router's own record."""

    def __init__(self, index: FleetIndex, name: str) -> None:
        self._index, self._name = index, name
        self._epoch: str | None = None

    def prepare(self, snapshot: SnapshotHead) -> tuple[str, PreparedSnapshot]:
        return snapshot.epoch, self._index.holdings(self._name).prepare(snapshot)

    def reset(self, prepared: tuple[str, PreparedSnapshot]) -> None:
        epoch, snapshot = prepared
        if self._epoch is not None and epoch != self._epoch:
            self._index.restarted(self._name)
        self._epoch = epoch
        self._index.holdings(self._name).reset(snapshot)

    def forget(self) -> None:
        self._index.forget(self._name)

    def apply(self, batch: Batch) -> None:
        self._index.holdings(self._name).apply(batch)
