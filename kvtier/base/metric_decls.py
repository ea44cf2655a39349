"""Metric declarations: each metric of kvtier declared once, in the module that owns it, and listed by ``declared()``.

A declaration states a metric's exposed name, kind, help text, label names and (histograms) buckets;
``Metrics`` (kvtier.base.metrics) creates its prometheus-client family from it on first use.

This ground layer knows only the declarations made so far, by the modules imported so far: it never names the
modules above it. A module that uses a metric by name imports the module that declares it (a test checks the
import graph), so the name is known when used. The complete list, which must import every declaring module,
lives at the top of the layers: ``kvtier.metric_owners.declared()``.
"""

from __future__ import annotations

import enum
import os
import re
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Latency buckets in seconds, from 50 us to 10 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

#: Set to ``1`` to make an undeclared metric name raise instead of being logged and counted.
STRICT_ENV = "KVTIER_METRICS_STRICT"

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class MetricKind(enum.StrEnum):
    """A metric's Prometheus type; equal to its string (``MetricKind.COUNTER == "counter"``)."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


Family = Counter | Gauge | Histogram
FAMILY_OF_KIND: dict[MetricKind, type[Family]] = {
    MetricKind.COUNTER: Counter, MetricKind.GAUGE: Gauge, MetricKind.HISTOGRAM: Histogram}
KIND_OF_FAMILY = {cls: kind for kind, cls in FAMILY_OF_KIND.items()}


@dataclass(frozen=True)
class MetricDecl:
    """One metric as declared: its exposed name, kind, help text, label names and (histograms) buckets.

    Invariants (checked, ValueError otherwise): a valid Prometheus name, non-empty help, valid and distinct
    label names, counters named ``*_total`` and only counters, buckets only (and always) on histograms.
    """

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise ValueError(f"metric {self.name!r}: {problem}")

    def family(self, registry: CollectorRegistry) -> Family:
        """A new prometheus-client metric of this declaration in ``registry`` (label names sorted, as exposed)."""
        options = {"buckets": self.buckets} if self.kind is MetricKind.HISTOGRAM else {}
        return FAMILY_OF_KIND[self.kind](self.name, self.help, tuple(sorted(self.labels)), registry=registry, **options)


def _problem(decl: MetricDecl) -> str:
    if not _NAME.match(decl.name):
        return "not a Prometheus metric name"
    if not decl.help.strip():
        return "help text is empty"
    if len(set(decl.labels)) != len(decl.labels) or not all(_LABEL.match(x) and not x.startswith("__")
                                                            for x in decl.labels):
        return f"bad label names {decl.labels}"
    if (decl.kind is MetricKind.COUNTER) != decl.name.endswith("_total"):
        return "counters, and only counters, are named *_total"
    if (decl.kind is MetricKind.HISTOGRAM) != bool(decl.buckets):
        return "histograms, and only histograms, have buckets"
    return ""


_declared: dict[str, MetricDecl] = {}
_declare_lock = threading.Lock()


def _declare(decl: MetricDecl) -> MetricDecl:
    with _declare_lock:
        known = _declared.setdefault(decl.name, decl)
    if known != decl:
        raise ValueError(f"metric {decl.name} declared twice, differently: {known} and {decl}")
    return known


def declare_counter(name: str, help: str, labels: tuple[str, ...] = ()) -> MetricDecl:
    """Declare the counter ``name`` (ending ``_total``); declaring it again identically returns the first."""
    return _declare(MetricDecl(name, MetricKind.COUNTER, help, tuple(labels)))


def declare_gauge(name: str, help: str, labels: tuple[str, ...] = ()) -> MetricDecl:
    """Declare the gauge ``name`` (set by an ``add_gauges`` callback, or only ever ``inc``-ed)."""
    return _declare(MetricDecl(name, MetricKind.GAUGE, help, tuple(labels)))


def declare_histogram(name: str, help: str, labels: tuple[str, ...] = (),
                      buckets: tuple[float, ...] = LATENCY_BUCKETS) -> MetricDecl:
    """Declare the histogram ``name`` (latency buckets unless ``buckets`` are given)."""
    return _declare(MetricDecl(name, MetricKind.HISTOGRAM, help, tuple(labels), tuple(buckets)))


def declarations_so_far() -> list[MetricDecl]:
    """The declarations made so far in this process (by the modules imported so far), sorted by name. Every
    declaration of kvtier: ``kvtier.metric_owners.declared()``."""
    with _declare_lock:
        return sorted(_declared.values(), key=lambda d: d.name)


def declaration(name: str) -> MetricDecl | None:
    """The declaration of ``name``, or None if no module imported so far declares it."""
    return _declared.get(name)


def help_text(name: str) -> str:
    """The declared help of ``name``, or the name itself if undeclared."""
    decl = declaration(name)
    return decl.help if decl is not None else name


def strict() -> bool:
    """Whether undeclared names raise (``KVTIER_METRICS_STRICT=1``) rather than being logged and counted."""
    return os.environ.get(STRICT_ENV) == "1"
