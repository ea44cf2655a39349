"""Counters, gauges and histograms on prometheus-client, declared once, readable from Python and as Prometheus text.

Every metric is declared once, at import of the module that owns it, with its name, help, label names and
kind (``declare_counter``, ``declare_gauge``, ``declare_histogram``); ``kvtier.metric_owners.declared()`` lists
them all (for the generated reference). A module using a metric by name imports the module that declares it.

One ``Metrics`` object per KVCache (no module globals), shared with its tiers; it owns a ``CollectorRegistry``
of its own (``metrics.registry``), so two caches in one process never mix their series and any
prometheus-client exporter (``generate_latest``, ``start_http_server``, a WSGI/ASGI app) can serve it.
Recording and reading take a declaration or its name; a family is created on first use, from its declaration.

* Labels must match the declaration's label names, else ValueError naming both (in every mode). Recording
  with the wrong kind (``observe`` of a counter, ``inc`` of a histogram) raises ValueError too.
* An undeclared name raises ValueError when the environment variable ``KVTIER_METRICS_STRICT`` is ``1``
  (the test suite sets it). Otherwise (production) it is logged and counted in
  ``kvtier_undeclared_metric_total{name}`` once per name, and recorded as before declarations existed: ``inc`` of a
  ``*_total`` name is a Counter, ``inc`` of another name a Gauge, ``observe`` a latency Histogram, with the
  label names of the first call. A metric never takes a serving path down; the tests catch the typo.

``inc`` of a declared gauge only goes up. ``add_gauges`` registers a callback read at each scrape; the names it
yields must be declared gauges (same strictness). Names follow Prometheus conventions: ``kvtier_<what>_total``
for counters (required: a Counter's exposed name is its declared name), ``_seconds``/``_bytes`` units.
Declarations live in kvtier.base.metric_decls and are re-exported here. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric

from kvtier.base.metric_decls import (
    KIND_OF_FAMILY,
    LATENCY_BUCKETS,
    STRICT_ENV,
    Family,
    MetricDecl,
    MetricKind,
    declaration,
    declarations_so_far,
    declare_counter,
    declare_gauge,
    declare_histogram,
    help_text,
    strict,
)

__all__ = [
    "CONTENT_TYPE", "LATENCY_BUCKETS", "STRICT_ENV", "MetricDecl", "MetricKind", "Metrics", "MetricsServer",
    "declaration", "declarations_so_far", "declare_counter", "declare_gauge", "declare_histogram", "help_text",
    "strict",
]

log = logging.getLogger(__name__)

#: The media type of ``render_prometheus()`` (Prometheus text format 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

UNDECLARED = declare_counter("kvtier_undeclared_metric_total",
                             "Metric names used without a matching declaration, each counted and logged once (a bug).",
                             ("name",))

GaugeCallback = Callable[[], Iterator[tuple[str, dict[str, str], float]]]
#: A metric as the recording and reading methods take it: its declaration, or its name.
MetricRef = MetricDecl | str


class _CallbackGauges:
    """A prometheus-client collector over ``add_gauges`` callbacks: one gauge family per name."""

    def __init__(self, undeclared: Callable[[str, str], None]) -> None:
        self._callbacks: list[GaugeCallback] = []
        self._lock = threading.Lock()
        self._undeclared = undeclared

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
                    family = families[name] = Metric(name, self._help(name, labels), "gauge")
                family.add_sample(name, {k: str(v) for k, v in sorted(labels.items())}, float(value))
        yield from families.values()

    def _help(self, name: str, labels: dict[str, str]) -> str:
        decl = declaration(name)
        if decl is None:
            self._undeclared(name, "is not declared")
            return name
        if decl.kind is not MetricKind.GAUGE or sorted(labels) != sorted(decl.labels):
            self._undeclared(name, f"is declared as a {decl.kind} with labels {sorted(decl.labels)}, "
                                   f"not yielded as a gauge with labels {sorted(labels)}")
        return decl.help


class Metrics:
    """kvtier's metrics API over one prometheus-client registry, for declared metrics (see the module doc)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._families: dict[str, Family] = {}
        self._label_names: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._gauges = _CallbackGauges(self._undeclared)
        self.registry.register(self._gauges)

    # -- recording -------------------------------------------------------------------------------------------
    def inc(self, metric: MetricRef, value: float = 1, **labels: str) -> None:
        """Add ``value`` (>= 0 for counters) to the series ``metric{labels}`` of a counter or gauge."""
        self._series(metric, (Counter, Gauge), labels).inc(value)

    def observe(self, metric: MetricRef, seconds: float, **labels: str) -> None:
        """Record one observation in the histogram ``metric{labels}``."""
        self._series(metric, (Histogram,), labels).observe(seconds)

    @contextmanager
    def timer(self, metric: MetricRef, **labels: str) -> Iterator[None]:
        """Observe the seconds the ``with`` body took (also when it raises) in the histogram ``metric``."""
        start = perf_counter()
        try:
            yield
        finally:
            self.observe(metric, perf_counter() - start, **labels)

    def add_gauges(self, collect: GaugeCallback) -> None:
        """Register a callback yielding ``(name, labels, value)`` of declared gauges, read at each
        render/snapshot."""
        self._gauges.add(collect)

    # -- reading ---------------------------------------------------------------------------------------------
    def get(self, metric: MetricRef, **labels: str) -> float:
        """A counter's or gauge's value (0 if never recorded), or a histogram's observation count."""
        family = self._family_to_read(metric)
        if family is None:
            return 0.0
        name = _name(metric)
        sample = name + "_count" if isinstance(family, Histogram) else name
        wanted = {k: str(v) for k, v in labels.items()}
        return next((s.value for s in self._samples_of(family) if s.name == sample and s.labels == wanted), 0.0)

    def total(self, metric: MetricRef) -> float:
        """A counter summed over all its label sets (0 if never incremented)."""
        family = self._family_to_read(metric)
        if family is None:
            return 0.0
        return sum(s.value for s in self._samples_of(family) if s.name == _name(metric))

    def samples(self, kind: MetricKind) -> Iterator[tuple[str, dict[str, str], float]]:
        """``(name, labels, value)`` of every series of one kind (counters: their ``_total`` values only;
        gauges: ``inc`` gauges and ``add_gauges`` callbacks; histograms: buckets, counts and sums)."""
        with self._lock:
            families = [f for f in self._families.values() if KIND_OF_FAMILY[type(f)] is kind]
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
    def _series(self, metric: MetricRef, kinds: tuple[type[Family], ...], labels: dict[str, str]):
        name = _name(metric)
        family = self._families.get(name) or self._create(metric, kinds[0], labels)
        if not isinstance(family, kinds):
            raise ValueError(f"metric {name} is a {type(family).__name__.lower()}, "
                             f"not a {' or '.join(k.__name__.lower() for k in kinds)}")
        if not labels and not self._label_names[name]:
            return family
        try:
            return family.labels(**labels)
        except ValueError:
            raise ValueError(f"metric {name} has labels {list(self._label_names[name])}, "
                             f"not {sorted(labels)}") from None

    def _create(self, metric: MetricRef, kind: type[Family], labels: dict[str, str]) -> Family:
        decl = metric if isinstance(metric, MetricDecl) else declaration(metric)
        if decl is None:
            self._undeclared(metric, "is not declared")  # raises in strict mode
        name, label_names = _name(metric), tuple(sorted(labels if decl is None else decl.labels))
        with self._lock:
            family = self._families.get(name)
            if family is None:  # else another thread created it first
                family = decl.family(self.registry) if decl else _undeclared_family(name, kind, label_names,
                                                                                    self.registry)
                self._families[name], self._label_names[name] = family, label_names
            return family

    def _family_to_read(self, metric: MetricRef) -> Family | None:
        family = self._families.get(_name(metric))
        if family is None and isinstance(metric, str) and declaration(metric) is None:
            self._undeclared(metric, "is not declared")
        return family

    def _undeclared(self, name: str, problem: str) -> None:
        """Raise in strict mode; otherwise log and count ``name`` (once per name and Metrics object)."""
        message = f"metric {name} {problem} (declare it once, in the module that owns it; see kvtier.base.metrics)"
        if strict():
            raise ValueError(message)
        with self._lock:
            first = name not in self._warned
            self._warned.add(name)
        if first:
            log.warning(message)
            self.inc(UNDECLARED, name=name)

    @staticmethod
    def _samples_of(family: Family):
        return [s for metric in family.collect() for s in metric.samples]


def _name(metric: MetricRef) -> str:
    return metric if isinstance(metric, str) else metric.name


def _undeclared_family(name: str, kind: type[Family], label_names: tuple[str, ...],
                       registry: CollectorRegistry) -> Family:
    """A family for an undeclared name, as names were recorded before declarations (production only)."""
    if kind is Counter and not name.endswith("_total"):
        kind = Gauge  # a Counter would expose the name with _total appended
    options = {"buckets": LATENCY_BUCKETS} if kind is Histogram else {}
    return kind(name, name, label_names, registry=registry, **options)


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
