"""Pooled tier on Mooncake Store: every replica's spare memory holds prefix KV for all of them.

Pool
    A ``mooncake_master`` keeps the metadata; each replica's tier is a Mooncake client that mounts a segment of
    its own memory (``segment_bytes``, or ``segment_share`` of what is free; 0 for none) into one pool, and
    values move directly between replicas through Mooncake's transfer engine (TCP, or RDMA). The master places
    each value whole in one segment (``--allocation_strategy``: ``random`` by default; ``free_ratio_first``
    fills segments of different sizes evenly) and evicts approximately least-recently-used values once the
    pool passes its high watermark or a put finds no room (that put is skipped; the next ones fit).

Keys and values
    ``<key_prefix><codec>:<chunk hash hex>``. The chunk hash covers model, KV spec, chunk size, TP rank, adapter
    and tenant salt; the codec in the key keeps codecs apart. Values are sealed, checksummed blobs: KVCache
    verifies every read, so a planted, truncated or foreign value is a miss and is deleted.

Transfers
    Zero-copy both ways: a put writes each blob into registered memory the tier owns (buffers.py) and the
    engine sends it from there (``batch_put_from``); a get asks the master for the values' sizes
    (``batch_get_replica_desc``), then the engine writes them straight into registered memory
    (``batch_get_into``), where they stay until the ``with`` block ends. One get's values share the buffer
    (``max_get_bytes``, ``BoundedGets``): the cache cuts its reads to fit it, and batches that together exceed it
    wait for each other within their deadline. Measured against the other calls in benchmarks/mooncake_calls.py.

Failures
    Every call has one deadline, ``timeout_s`` plus one second per ``min_rate_bytes`` moved, enforced by
    running the engine's blocking calls on worker threads (calls.py). A dead or hung master or peer costs a
    request at most that; it gives misses and skipped stores, counted. A call that this replica queued (for the
    buffer, turns, workers) until less than half of ``timeout_s`` was left, and that ran out, is busy, not a fault.
    ``breaker_failures`` consecutive failures of the master open the circuit breaker: requests skip the pool at
    once while a background thread probes the master every ``breaker_cooldown_s`` and closes the breaker when it
    answers. A tier that cannot reach the master at start serves misses and keeps trying to join. Values of a
    replica that leaves are gone: at once when it closes, when the master notices its silence (``--client_ttl``)
    when it dies; reads of them meanwhile fail fast and are misses.
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from time import monotonic

from kvtier.base.errors import TierError
from kvtier.base.keys import ChunkHash
from kvtier.base.metrics import LATENCY_BUCKETS, declare_counter, declare_gauge, declare_histogram
from kvtier.codecs import Payload, get_codec
from kvtier.net.breaker import CircuitBreaker
from kvtier.tiers.base import TierContext, TierStats, stats_gauges
from kvtier.tiers.health_worker import HealthWorker
from kvtier.tiers.metrics import (
    BREAKER_OPEN,
    BREAKER_REJECTED,
    SKIPPED_STORES,
    TIER_ERRORS,
)
from kvtier.tiers.mooncake.buffers import RegisteredBuffers
from kvtier.tiers.mooncake.calls import CallTimedOut, DeadlineCalls
from kvtier.tiers.mooncake.client import MASTER_DOWN, Code, MooncakeClient
from kvtier.tiers.mooncake.config import MooncakeTierConfig
from kvtier.tiers.mooncake.control import MooncakeControl
from kvtier.tiers.mooncake.health import MooncakeHealth
from kvtier.tiers.mooncake.slices import Spill
from kvtier.tiers.mooncake.transfers import BUSY, MooncakeTransfers

log = logging.getLogger(__name__)

JOINED = declare_gauge("kvtier_mooncake_joined", "1 while the Mooncake tier is in the pool (its segment mounted), "
                       "else 0.", ("tier",))
SEGMENT_BYTES = declare_gauge("kvtier_mooncake_segment_bytes",
                              "Memory this replica contributes to the Mooncake pool.", ("tier",))
BUFFER_BYTES = declare_gauge("kvtier_mooncake_buffer_bytes",
                             "Registered memory the Mooncake tier moves values through.", ("tier",))
STAGE_SECONDS = declare_histogram(
    "kvtier_mooncake_stage_seconds", "Where a Mooncake tier call's time went, by stage: sizes (a get asking the "
    "master for its values' sizes), buffer (waiting for room in the transfer buffer), copy (a put writing its values "
    "into it), turn (waiting for a transfer turn), start (a worker taking the call up), transfer (the engine's call; "
    "late ones included, when they end), held (the caller reading a get's values out of the buffer).",
    ("op", "stage", "tier"), LATENCY_BUCKETS + (20.0, 30.0, 60.0))
TRANSFER_FAILURES = declare_counter("kvtier_mooncake_transfer_failures_total",
                                    "Mooncake calls in which a peer holding a value did not answer.", ("op", "tier"))

#: Engine calls in flight at once per tier (requests beyond it wait for a worker, within their deadline).
WORKERS = 8
#: Spill memory kept for gets larger than the transfer buffer, at most this many times its size (transfers.py)
SPILL_KEEP_BUFFERS = 4
#: The pool's figures in the gauges are at most this old: each refresh is an HTTP request to the master, and
#: gauges are read on every scrape (and by vLLM's stats channel every second, in every worker).
GAUGE_STATS_MAX_AGE_S = 5.0
_POOL_GAUGES = {"master_allocated_bytes": 0, "master_total_capacity_bytes": 1, "master_key_count": 2}


class MooncakeTier(MooncakeTransfers, MooncakeControl, MooncakeHealth):
    """The Tier protocol over a Mooncake Store pool (see the module docstring); ``Controlled`` for clears only
    (control.py says what Mooncake cannot do); joining late and probing the master in health.py."""

    verifies = True

    def __init__(self, config: MooncakeTierConfig, ctx: TierContext) -> None:
        self.name = ctx.name
        self.config = config
        self.codec = get_codec(config.codec)
        self._metrics = ctx.metrics
        self._root = f"{config.key_prefix}{self.codec.name}:"  #: every key of this prefix and codec (clear all)
        self._prefix = self._root + (f"{ctx.namespace}:" if ctx.namespace else "")  #: this model's keys
        self._probe_key = f"{config.key_prefix}probe"
        self._calls = DeadlineCalls(WORKERS, ctx.name)
        self._breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s,
                                       on_change=self._breaker_changed)
        self._last_stats = TierStats(0, 0, 0)
        self._stats_read_at = float("-inf")
        self._closed = False
        self._lock = threading.Lock()
        self._health = HealthWorker(f"kvtier-{self.name}-health", self._watch_turns, self._lock,
                                    lambda: self._closed, f"mooncake tier {self.name}")
        self._client = MooncakeClient(config, self._calls, on_joined=self._health.wake.set, timed=self._timed_stage)
        self._buffers = RegisteredBuffers(config.buffer_bytes, self._client.register)
        self.max_get_bytes = self._buffers.capacity  #: BoundedGets: a get within it is read in one call
        self._spill = Spill(SPILL_KEEP_BUFFERS * self._buffers.capacity)
        self._metrics.add_gauges(self._gauges)
        if not self._client.join(monotonic() + config.connect_timeout_s):
            log.warning("mooncake tier %s: master %s not reachable yet; misses until it is", self.name,
                        config.master_address)
            self._start_health()

    @property
    def joined(self) -> bool:
        """Whether this replica is in the pool now (its segment mounted, its calls going to the master)."""
        return self._client.joined

    # -- the Tier protocol ---------------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkHash]) -> list[bool]:
        if not keys or not self._usable("contains"):
            return [False] * len(keys)
        try:
            codes = self._client.exists(self._names(keys), monotonic() + self.config.timeout_s)
        except TierError as exc:
            self._failed("contains", exc)
            return [False] * len(keys)
        self._judge("contains", codes)
        return [code == 1 for code in codes]

    @contextmanager
    def get(self, keys: Sequence[ChunkHash]) -> Iterator[list[memoryview | None]]:
        views: list[memoryview | None] = [None] * len(keys)
        releases = self._get(keys, views) if keys and self._usable("get") else []
        handed = monotonic()
        try:
            yield views
        finally:
            for release in releases:
                release()
            if releases:
                self._timed_stage("get", "held", monotonic() - handed)

    def put(self, items: Sequence[tuple[ChunkHash, Payload]]) -> list[bool]:
        out = [False] * len(items)
        todo = []
        for i, (_key, payload) in enumerate(items):
            if payload.nbytes > self.config.max_value_bytes:
                self._skipped("too_large")
            else:
                todo.append(i)
        if not todo:
            return out
        if not self._usable("put"):
            self._skipped("unavailable", len(todo))
            return out
        self._put_slices(items, todo, out)
        return out

    def delete(self, keys: Sequence[ChunkHash]) -> None:
        if not keys or not self._usable("delete"):
            return
        try:
            self._judge("delete", self._client.remove(self._names(keys), monotonic() + self.config.timeout_s))
        except TierError as exc:
            self._failed("delete", exc)

    def stats(self) -> TierStats:
        """The whole pool's used bytes, capacity and key count, from the master's metrics endpoint (the last
        figures read when it does not answer)."""
        try:
            with urllib.request.urlopen(self.config.master_metrics_url, timeout=self.config.timeout_s) as resp:
                text = resp.read().decode("ascii", "replace")
        except (OSError, urllib.error.URLError) as exc:
            log.debug("mooncake tier %s: master metrics: %s", self.name, exc)
            return self._last_stats
        figures = [0, 0, 0]
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in _POOL_GAUGES:
                try:
                    figures[_POOL_GAUGES[name]] = int(float(value))
                except ValueError:
                    return self._last_stats
        self._last_stats = TierStats(*figures)
        self._stats_read_at = monotonic()
        return self._last_stats

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._health.wake.set()
        if self._calls.close(wait_s=self.config.connect_timeout_s):
            self._client.close()  # nothing is using the engine any more: leave the pool
        else:  # tearing the engine down under a call still inside it would crash the process
            log.warning("mooncake tier %s: calls still stuck in the engine at close; leaving this replica's "
                        "segment to the master's client TTL", self.name)

    # -- health --------------------------------------------------------------------------------------------
    def _usable(self, op: str) -> bool:
        if self._client.joined and self._breaker.allow():
            return True
        self._metrics.inc(BREAKER_REJECTED, tier=self.name, op=op)
        return False

    def _judge(self, op: str, codes: Sequence[int]) -> None:
        """A batch whose every item says the master is unreachable is a failure; anything else a success."""
        if codes and all(code in MASTER_DOWN for code in codes):
            self._failed(op, TierError(f"master unreachable (code {codes[0]})"))
        else:
            if any(code == Code.TRANSFER_FAIL for code in codes):
                self._metrics.inc(TRANSFER_FAILURES, tier=self.name, op=op)
            self._breaker.success()

    def _failed(self, op: str, exc: Exception) -> None:
        self._metrics.inc(TIER_ERRORS, tier=self.name, op=op)
        log.warning("mooncake tier %s: %s failed: %s", self.name, op, exc)
        self._breaker.failure()

    def _timed_out(self, op: str, exc: CallTimedOut) -> bool:
        """A call past its deadline is the pool's failure (True) when it had half of ``timeout_s`` or more on its
        worker; one that this replica queued (for the transfer buffer, turns, workers) until less was left is busy."""
        if exc.ran_s >= self.config.timeout_s / 2:
            self._failed(op, exc)
            return True
        self._metrics.inc(BUSY, tier=self.name, op=op)
        log.info("mooncake tier %s: %s ran out of the %.1fs left after queueing here", self.name, op, exc.ran_s)
        return False

    def _timed_stage(self, op: str, stage: str, seconds: float) -> None:
        self._metrics.observe(STAGE_SECONDS, seconds, op=op, stage=stage, tier=self.name)

    def _skipped(self, reason: str, n: int = 1) -> None:
        if n:
            self._metrics.inc(SKIPPED_STORES, n, tier=self.name, reason=reason)

    # -- names and gauges ------------------------------------------------------------------------------------
    def _name(self, key: ChunkHash) -> str:
        return self._prefix + key.hex()

    def _names(self, keys: Sequence[ChunkHash]) -> list[str]:
        return [self._prefix + key.hex() for key in keys]

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        labels = {"tier": self.name}
        recent = monotonic() - self._stats_read_at < GAUGE_STATS_MAX_AGE_S
        yield from stats_gauges(self, self._last_stats if recent else self.stats())
        yield BREAKER_OPEN.name, {**labels, "node": self.config.master_address}, float(self._breaker.state)
        yield JOINED.name, labels, float(self._client.joined)
        yield SEGMENT_BYTES.name, labels, float(self._client.segment_bytes if self._client.joined else 0)
        yield BUFFER_BYTES.name, labels, float(self._buffers.registered_bytes)
