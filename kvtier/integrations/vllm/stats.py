"""Connector statistics in vLLM's own stats channel: logged by vLLM, and exported by its Prometheus endpoint.

Each worker reports, per step: tokens loaded from kvtier into vLLM's blocks, blocks it could not fill
(recomputed by vLLM), loads cut short by their deadline, tokens newly stored, save jobs over, requests saved and
loads with sliding-window groups that failed whole (logged with vLLM's other KV transfer metrics), plus its
KVCache's metrics: how much every counter grew since the last report and the current value of every gauge (at
most once per ``GAUGE_INTERVAL_S``: a gauge may ask a remote store). vLLM sums the reports of its
tensor-parallel workers; ``prom.py`` turns them into vLLM Prometheus metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.base.metrics import MetricKind, Metrics

FIELDS = ("loaded_tokens", "failed_blocks", "expired_loads", "stored_tokens", "save_jobs", "saved_requests",
          "failed_loads")
#: Seconds between two reports of the cache's gauges (counters are reported whenever they moved).
GAUGE_INTERVAL_S = 1.0

#: A series as it travels: [name, {label: value}, value] (plain lists and dicts: vLLM serializes stats).
Series = list


def _key(series: Series) -> tuple[str, tuple[tuple[str, str], ...]]:
    return series[0], tuple(sorted(series[1].items()))


def _sum_series(a: list[Series], b: list[Series]) -> list[Series]:
    """Both lists' series, values of the same name and labels added (new lists: inputs stay untouched)."""
    merged = {_key(s): [s[0], dict(s[1]), s[2]] for s in a}
    for s in b:
        if _key(s) in merged:
            merged[_key(s)][2] += s[2]
        else:
            merged[_key(s)] = [s[0], dict(s[1]), s[2]]
    return list(merged.values())


@dataclass
class KVTierStats(KVConnectorStats):
    """``data``: the FIELDS counts, ``counters`` (increments) and ``gauges`` (values), summed over workers."""

    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)
        self.data.setdefault("counters", [])
        self.data.setdefault("gauges", [])

    def reset(self) -> None:
        self.data = {**dict.fromkeys(FIELDS, 0), "counters": [], "gauges": []}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        for name in FIELDS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        for name in ("counters", "gauges"):
            self.data[name] = _sum_series(self.data.get(name, []), other.data.get(name, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"kvtier_{name}": self.data.get(name, 0) for name in FIELDS}

    def is_empty(self) -> bool:
        return not (any(self.data.get(name, 0) for name in FIELDS) or self.data.get("counters")
                    or self.data.get("gauges"))


class MetricsFeed:
    """What a worker's KVCache metrics did since the last ``take()``, as KVTierStats data."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._last: dict[tuple, float] = {}
        self._gauges_at = float("-inf")

    def take(self) -> dict[str, Any]:
        """``{"counters": [...increments], "gauges": [...values]}``, without the parts that have nothing new."""
        grown = []
        for name, labels, value in self.metrics.samples(MetricKind.COUNTER):
            key = (name, tuple(sorted(labels.items())))
            if value != self._last.get(key, 0.0):
                grown.append([name, labels, value - self._last.get(key, 0.0)])
                self._last[key] = value
        out: dict[str, Any] = {"counters": grown} if grown else {}
        now = time.monotonic()
        if grown and now - self._gauges_at >= GAUGE_INTERVAL_S:
            self._gauges_at = now
            out["gauges"] = [[n, labels, v] for n, labels, v in self.metrics.samples(MetricKind.GAUGE)]
        return out
