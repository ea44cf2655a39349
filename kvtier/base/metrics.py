"""Counters, gauges and histograms on prometheus-client, readable from Python and as Prometheus text.

One ``Metrics`` object per KVCache (no module globals), shared with its tiers; it owns a ``CollectorRegistry``
of its own (``metrics.registry``), so two caches in one process never mix their series and any
prometheus-client exporter (``generate_latest``, ``start_http_server``, a WSGI/ASGI app) can serve it.

Names need no declaration: the first ``inc`` or ``observe`` of a name creates its metric with the label names
of that call, and later calls must use the same label names (prometheus-client's rule; a mismatch raises
ValueError naming both). ``inc`` of a ``*_total`` name is a Counter; ``inc`` of any other name is a Gauge
that only goes up, so the exposed name is exactly the one given (a Counter would gain ``_total``).
``observe`` feeds a Histogram with latency buckets. ``add_gauges`` registers a callback read at each
scrape. Names follow Prometheus conventions: ``kvtier_<what>_total`` for counters, ``_seconds``/``_bytes``
units. Thread-safe.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric

#: Latency buckets in seconds, from 50 us to 10 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

HELP = {
    "kvtier_lookups_total": "Lookups served.",
    "kvtier_lookup_tokens_total": "Tokens asked about by lookups (full chunks only).",
    "kvtier_hit_tokens_total": "Tokens retrieved, by the tier that served them.",
    "kvtier_miss_tokens_total": "Tokens asked for by retrieve that no tier could serve.",
    "kvtier_stored_tokens_total": "Tokens written, by tier.",
    "kvtier_read_bytes_total": "Stored bytes read, by tier.",
    "kvtier_written_bytes_total": "Stored bytes written, by tier.",
    "kvtier_evictions_total": "Entries evicted, by tier.",
    "kvtier_skipped_stores_total": "Chunks not stored, by tier and reason.",
    "kvtier_corrupt_chunks_total": "Stored chunks that failed verification and were treated as misses.",
    "kvtier_state_snapshots_stored_total": "SSM state snapshots (one per kind and boundary) written, by tier.",
    "kvtier_state_snapshots_loaded_total": "SSM state snapshots restored, by tier and kind.",
    "kvtier_tier_errors_total": "Tier failures turned into misses or skipped stores.",
    "kvtier_promotions_total": "Chunks copied into a faster tier after a hit in a slower one.",
    "kvtier_demotions_total": "Chunks written to a slower tier when a faster one evicted them.",
    "kvtier_breaker_opens_total": "Times a tier's circuit breaker opened (a server kept failing).",
    "kvtier_breaker_rejected_total": "Tier calls skipped because the server's circuit breaker was open.",
    "kvtier_breaker_open": "1 while the circuit breaker of a tier's server is open, else 0.",
    "kvtier_incomplete_values_total": "Split values found with a part missing (evicted or expired): misses.",
    "kvtier_disk_io_errors_total": "Disk tier I/O failures, by step (write, fsync, read, ...) and errno.",
    "kvtier_disk_leftovers_removed_total": "Files removed by the disk tier at start: temp, torn or stray.",
    "kvtier_disk_directory_lost_total": "Times the disk tier found its directory gone and dropped its index.",
    "kvtier_disk_reindex_seconds": "Time the disk tier took to rebuild its index from the directory.",
    "kvtier_disk_write_queue": "Stores queued for the disk tier's background writer.",
    "kvtier_segment_hit_tokens_total": "Tokens of cached segments retrieved for blending, by the tier that served them.",
    "kvtier_segment_miss_tokens_total": "Tokens of segments asked for that no tier held (computed, then stored).",
    "kvtier_segment_stored_tokens_total": "Tokens of segments written, by tier.",
    "kvtier_segment_retrieve_seconds": "Latency of retrieving a prompt's cached segments.",
    "kvtier_blend_blended_tokens_total": "Prompt tokens whose KV came from cached segments and was not recomputed.",
    "kvtier_blend_recomputed_tokens_total": "Reused segment tokens recomputed because their KV deviated most.",
    "kvtier_blend_fallback_tokens_total": "Segment tokens given a full prefill instead, by reason (deviation, unsupported).",
    "kvtier_mooncake_joined": "1 while the Mooncake tier is in the pool (its segment mounted), else 0.",
    "kvtier_mooncake_segment_bytes": "Memory this replica contributes to the Mooncake pool.",
    "kvtier_mooncake_buffer_bytes": "Registered memory the Mooncake tier moves values through.",
    "kvtier_mooncake_no_buffer_total": "Values not read because the Mooncake tier's transfer buffer was full.",
    "kvtier_mooncake_busy_total": "Mooncake reads given up because other transfers held every turn until the deadline.",
    "kvtier_mooncake_transfer_failures_total": "Mooncake calls in which a peer holding a value did not answer.",
    "kvtier_lookup_seconds": "Latency of lookup().",
    "kvtier_retrieve_seconds": "Latency of retrieve().",
    "kvtier_store_seconds": "Latency of store().",
    "kvtier_tier_used_bytes": "Bytes held by a tier.",
    "kvtier_tier_capacity_bytes": "Configured capacity of a tier.",
    "kvtier_tier_entries": "Chunks held by a tier.",
    "kvtier_server_requests_total": "HTTP generation requests answered, by endpoint and status.",
    "kvtier_server_rejected_total": "Requests refused at once because the queue was full.",
    "kvtier_server_prompt_tokens_total": "Prompt tokens of completed requests.",
    "kvtier_server_cached_prompt_tokens_total": "Prompt tokens whose KV came from kvtier instead of prefill.",
    "kvtier_server_blended_prompt_tokens_total": "Prompt tokens whose KV came from cached segments (blending).",
    "kvtier_server_generation_tokens_total": "Completion tokens generated.",
    "kvtier_server_ttft_seconds": "Time to first token inside the engine (retrieve + prefill + first token).",
    "kvtier_server_queue_seconds": "Time a request waited for the engine.",
    "kvtier_server_requests_in_flight": "Requests running or waiting.",
    "kvtier_server_queue_limit": "Requests that may be running or waiting before 429s.",
}

#: The media type of ``render_prometheus()`` (Prometheus text format 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

class MetricKind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


_KINDS = {Counter: MetricKind.COUNTER, Gauge: MetricKind.GAUGE, Histogram: MetricKind.HISTOGRAM}

GaugeCallback = Callable[[], Iterator[tuple[str, dict[str, str], float]]]
_Family = Counter | Gauge | Histogram


class _CallbackGauges:
    """A prometheus-client collector over ``add_gauges`` callbacks: one gauge family per name."""

    def __init__(self) -> None:
        self._callbacks: list[GaugeCallback] = []
        self._lock = threading.Lock()

    def add(self, collect: GaugeCallback) -> None:
        with self._lock:
            self._callbacks.append(collect)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            callbacks = list(self._callbacks)
        families: dict[str, Metric] = {}
        for collect in callbacks:
            for name, labels, value in collect():
                family = families.get(name)
                if family is None:
                    family = families[name] = Metric(name, HELP.get(name, name), "gauge")
                family.add_sample(name, {k: str(v) for k, v in sorted(labels.items())}, float(value))
        yield from families.values()


class Metrics:
    """kvtier's metrics API over one prometheus-client registry. Unknown names are allowed."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._families: dict[str, _Family] = {}
        self._label_names: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self._gauges = _CallbackGauges()
        self.registry.register(self._gauges)

    # -- recording -------------------------------------------------------------------------------------------
    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        """Add ``value`` (>= 0 for ``*_total`` counters) to the series ``name{labels}``."""
        kind = Counter if name.endswith("_total") else Gauge
        self._series(name, kind, labels).inc(value)

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        """Record one observation in the histogram ``name{labels}``."""
        self._series(name, Histogram, labels).observe(seconds)

    @contextmanager
    def timer(self, name: str, **labels: str) -> Iterator[None]:
        start = perf_counter()
        try:
            yield
        finally:
            self.observe(name, perf_counter() - start, **labels)

    def add_gauges(self, collect: GaugeCallback) -> None:
        """Register a callback yielding ``(name, labels, value)`` gauges, read at each render/snapshot."""
        self._gauges.add(collect)

    # -- reading ---------------------------------------------------------------------------------------------
    def get(self, name: str, **labels: str) -> float:
        """A counter's value (0 if never incremented), or a histogram's observation count."""
        family = self._families.get(name)
        if family is None:
            return 0.0
        sample = name + "_count" if isinstance(family, Histogram) else name
        wanted = {k: str(v) for k, v in labels.items()}
        return next((s.value for s in self._samples_of(family) if s.name == sample and s.labels == wanted), 0.0)

    def total(self, name: str) -> float:
        """A counter summed over all its label sets."""
        family = self._families.get(name)
        if family is None:
            return 0.0
        return sum(s.value for s in self._samples_of(family) if s.name == name)

    def samples(self, kind: MetricKind) -> Iterator[tuple[str, dict[str, str], float]]:
        """``(name, labels, value)`` of every series of one kind (counters: their ``_total`` values only;
        gauges: ``inc`` gauges and ``add_gauges`` callbacks; histograms: buckets, counts and sums)."""
        with self._lock:
            families = [f for f in self._families.values() if _KINDS[type(f)] is kind]
        collected = [m for f in families for m in f.collect()]
        if kind is MetricKind.GAUGE:
            collected += list(self._gauges.collect())
        for metric in collected:
            for sample in metric.samples:
                if kind is MetricKind.GAUGE or not sample.name.endswith("_created"):
                    yield sample.name, dict(sample.labels), float(sample.value)

    def snapshot(self) -> dict[str, float]:
        """Flat ``{"name{labels}": value}`` of counters, gauges and histogram buckets, counts and sums."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if family.type != "gauge" and sample.name.endswith("_created"):
                    continue  # prometheus-client's creation timestamps: not a kvtier reading
                out[sample.name + _fmt_labels(sample.labels)] = float(sample.value)
        return out

    def render_prometheus(self) -> str:
        """Prometheus text exposition format (version 0.0.4; media type ``CONTENT_TYPE``)."""
        return generate_latest(self.registry).decode()

    # -- internals -------------------------------------------------------------------------------------------
    def _series(self, name: str, kind: type[_Family], labels: dict[str, str]):
        family = self._families.get(name) or self._create(name, kind, tuple(sorted(labels)))
        if not isinstance(family, kind):
            raise ValueError(f"metric {name} is a {type(family).__name__.lower()}, not a {kind.__name__.lower()}")
        if not labels and not self._label_names[name]:
            return family
        try:
            return family.labels(**labels)
        except ValueError:
            raise ValueError(f"metric {name} has labels {list(self._label_names[name])}, "
                             f"not {sorted(labels)}") from None

    def _create(self, name: str, kind: type[_Family], label_names: tuple[str, ...]) -> _Family:
        with self._lock:
            family = self._families.get(name)
            if family is not None:  # another thread created it first
                return family
            options = {"buckets": LATENCY_BUCKETS} if kind is Histogram else {}
            family = kind(name, HELP.get(name, name), label_names, registry=self.registry, **options)
            self._label_names[name] = label_names
            self._families[name] = family
            return family

    @staticmethod
    def _samples_of(family: _Family):
        return [s for metric in family.collect() for s in metric.samples]


class MetricsServer:
    """``metrics`` served as Prometheus text at ``http://host:port/metrics`` from a daemon thread."""

    def __init__(self, metrics: Metrics, port: int, host: str = "127.0.0.1") -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _fmt_labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
