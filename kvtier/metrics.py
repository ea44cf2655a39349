"""Counters, gauges and histograms with Prometheus names, readable from Python and as Prometheus text.

One ``Metrics`` object per KVCache (no module globals), shared with its tiers. Thread-safe.
Names follow Prometheus conventions: ``kvtier_<what>_total`` for counters, ``_seconds``/``_bytes`` units.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

Labels = tuple[tuple[str, str], ...]

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


def _labels(labels: dict[str, str]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


class _Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1
        self.sum += value
        self.count += 1


class Metrics:
    """A small, thread-safe registry. Unknown names are allowed; HELP text is used when known."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, Labels], float] = {}
        self._histograms: dict[tuple[str, Labels], _Histogram] = {}
        self._gauges: list[Callable[[], Iterator[tuple[str, dict[str, str], float]]]] = []

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        key = (name, _labels(labels))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + value

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        key = (name, _labels(labels))
        with self._lock:
            hist = self._histograms.get(key)
            if hist is None:
                hist = self._histograms[key] = _Histogram()
            hist.observe(seconds)

    @contextmanager
    def timer(self, name: str, **labels: str) -> Iterator[None]:
        start = perf_counter()
        try:
            yield
        finally:
            self.observe(name, perf_counter() - start, **labels)

    def add_gauges(self, collect: Callable[[], Iterator[tuple[str, dict[str, str], float]]]) -> None:
        """Register a callback yielding ``(name, labels, value)`` gauges, read at each render/snapshot."""
        with self._lock:
            self._gauges.append(collect)

    def get(self, name: str, **labels: str) -> float:
        """A counter's value (0 if never incremented), or a histogram's observation count."""
        key = (name, _labels(labels))
        with self._lock:
            if key in self._histograms:
                return float(self._histograms[key].count)
            return self._counters.get(key, 0.0)

    def total(self, name: str) -> float:
        """A counter summed over all its label sets."""
        with self._lock:
            return sum(v for (n, _), v in self._counters.items() if n == name)

    def snapshot(self) -> dict[str, float]:
        """Flat ``{"name{labels}": value}`` of counters, gauges and histogram counts/sums."""
        out: dict[str, float] = {}
        for name, labels, value in self._samples():
            out[name + _fmt_labels(labels)] = value
        return out

    def render_prometheus(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        seen: set[str] = set()
        for name, labels, value in self._samples():
            family = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
            if family not in seen:
                seen.add(family)
                kind = "histogram" if family in self._histogram_names() else (
                    "counter" if family.endswith("_total") else "gauge")
                lines.append(f"# HELP {family} {HELP.get(family, family)}")
                lines.append(f"# TYPE {family} {kind}")
            lines.append(f"{name}{_fmt_labels(labels)} {value!r}")
        return "\n".join(lines) + "\n"

    def _histogram_names(self) -> set[str]:
        with self._lock:
            return {name for name, _ in self._histograms}

    def _samples(self) -> Iterator[tuple[str, Labels, float]]:
        with self._lock:
            counters = sorted(self._counters.items())
            histograms = sorted(self._histograms.items(), key=lambda item: item[0])
            gauges = list(self._gauges)
        for (name, labels), value in counters:
            yield name, labels, float(value)
        for collect in gauges:
            for name, labels, value in collect():
                yield name, _labels(labels), float(value)
        for (name, labels), hist in histograms:
            cumulative = 0
            for bound, count in zip((*LATENCY_BUCKETS, float("inf")), hist.counts):
                cumulative += count
                le = "+Inf" if bound == float("inf") else repr(bound)
                yield f"{name}_bucket", (*labels, ("le", le)), float(cumulative)
            yield f"{name}_sum", labels, hist.sum
            yield f"{name}_count", labels, float(hist.count)


def _fmt_labels(labels: Labels) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
