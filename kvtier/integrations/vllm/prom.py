"""kvtier's cache metrics on vLLM's Prometheus endpoint (``vllm serve``'s ``/metrics``).

vLLM builds this object in the process that serves its metrics and hands it every step's KVTierStats
(summed over the tensor-parallel workers). Every kvtier counter and gauge appears under vLLM's metric
prefix with its own name and labels plus vLLM's ``model_name`` and ``engine`` labels::

    kvtier_hit_tokens_total{tier="memory"}  ->  vllm:kvtier_hit_tokens_total{engine="0",model_name="...",tier="memory"}

The ``vllm:`` prefix is what vLLM unregisters when it rebuilds its loggers, so a restarted engine in the same
process starts clean. Histograms (latencies) stay on the workers' own registries: set ``metrics_port`` in
the connector's config to scrape those in full with kvtier's exact names (see connector.py).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvtier.base.metrics import help_text

PREFIX = "vllm:"


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Creates one vLLM metric per kvtier series name on first sight, with the help of its declaration."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._metrics: dict[str, Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for name, labels, value in transfer_stats_data.get("counters", []):
            if value > 0:
                self._series(Counter, name, labels, engine_labels).inc(value)
        for name, labels, value in transfer_stats_data.get("gauges", []):
            self._series(Gauge, name, labels, engine_labels).set(value)

    def _series(self, kind: type, name: str, labels: dict[str, str], engine_labels: list[str]):
        metric = self._metrics.get(name)
        if metric is None:
            label_names = [*self._labelnames, *sorted(labels)]
            if kind is Counter:
                metric = self._counter_cls(name=PREFIX + name, documentation=help_text(name),
                                           labelnames=label_names)
            else:
                metric = self._gauge_cls(name=PREFIX + name, documentation=help_text(name),
                                         labelnames=label_names, multiprocess_mode="mostrecent")
            self._metrics[name] = metric
        return metric.labels(*engine_labels, *(labels[k] for k in sorted(labels)))
