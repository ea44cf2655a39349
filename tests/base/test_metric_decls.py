"""Metric declarations: each metric declared once with help and labels, every name the code uses declared, and
the series a working cache exposes matching their declarations."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.metrics import (
    LATENCY_BUCKETS,
    MetricDecl,
    MetricKind,
    declare_counter,
    declare_histogram,
    declared,
)
from kvtier.tiers import DiskTierConfig, MemoryTierConfig, WriteMode

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
SOURCE = Path(kvtier.__file__).parent
#: A metric name in code: a string literal passed to a Metrics method, yielded by a gauge callback, or declared.
USE = re.compile(r'(?:\.(?:inc|observe|timer|get|total)\(|yield |declare_\w+\()\s*"(kvtier_\w+)"')


@pytest.fixture(scope="module")
def declarations() -> dict[str, MetricDecl]:
    return {d.name: d for d in declared()}


def test_declared_lists_every_metric_once_with_help_kind_and_labels(declarations):
    listed = declared()
    assert [d.name for d in listed] == sorted(declarations) and len(listed) == len(declarations)
    for d in listed:
        assert d.help.strip() and d.help != d.name, d.name
        assert d.kind in ("counter", "gauge", "histogram") and isinstance(d.labels, tuple), d.name
        assert all(isinstance(label, str) for label in d.labels), d.name
        assert d.name.endswith("_total") == (d.kind == "counter"), d.name
    for name in ("kvtier_hit_tokens_total", "kvtier_router_requests_total", "kvtier_server_ttft_seconds",
                 "kvtier_disk_write_queue", "kvtier_mooncake_joined", "kvtier_blend_fallback_tokens_total",
                 "kvtier_breaker_open", "kvtier_undeclared_metric_total"):
        assert name in declarations
    assert declarations["kvtier_skipped_stores_total"].labels == ("reason", "tier")
    assert declarations["kvtier_retrieve_seconds"].buckets == LATENCY_BUCKETS


def test_every_metric_name_in_the_code_is_declared(declarations):
    used: dict[str, list[str]] = {}
    for path in SOURCE.rglob("*.py"):
        for name in USE.findall(path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(SOURCE)))
    assert len(used) >= 70  # the scan finds the names (a broken pattern would pass vacuously)
    assert {name: where for name, where in used.items() if name not in declarations} == {}


def test_kind_is_a_string_for_the_reference():
    assert MetricKind.COUNTER == "counter" and f"{MetricKind.HISTOGRAM}" == "histogram"


@pytest.mark.parametrize("bad, problem", [
    (lambda: declare_counter("kvtier_test_things", "Things."), "only counters, are named"),
    (lambda: MetricDecl("kvtier_test_depth_total", MetricKind.GAUGE, "Depth."), "only counters, are named"),
    (lambda: declare_counter("kvtier_test_things_total", " "), "help text is empty"),
    (lambda: declare_counter("kvtier test_total", "Things."), "not a Prometheus metric name"),
    (lambda: declare_counter("kvtier_test_things_total", "Things.", ("tier", "tier")), "bad label names"),
    (lambda: declare_histogram("kvtier_test_seconds", "Time.", buckets=()), "only histograms, have buckets"),
    (lambda: declare_counter("kvtier_hit_tokens_total", "Hits.", ("tier",)), "declared twice, differently"),
])
def test_a_bad_declaration_raises(bad, problem):
    with pytest.raises(ValueError, match=problem):
        bad()


def test_declaring_again_identically_returns_the_first(declarations):
    first = declarations["kvtier_hit_tokens_total"]
    assert declare_counter(first.name, first.help, first.labels) is first


def used_cache(tmp_path: Path) -> KVCache:
    """A memory tier over a write-back disk tier, after stores, evictions, demotions, hits and promotions."""
    chunk_bytes = SPEC.bytes_per_token * 16 + 320
    tiers = (MemoryTierConfig(capacity_bytes=3 * chunk_bytes),
             DiskTierConfig(path=tmp_path, capacity_bytes=1 << 20, o_direct=False, fsync=False, write=WriteMode.BACK,
                            admission="always"))
    cache = KVCache(SPEC, "m@1", CacheConfig(chunk_size=16, tiers=tiers))
    prompts = [list(range(i * 100, i * 100 + 48)) for i in range(3)]
    disk = cache.tiers[1]
    for tokens in prompts:
        cache.store(tokens, torch.zeros(SPEC.chunk_shape(48), dtype=SPEC.dtype))
        disk.flush()  # demotions on disk before the next step: a busy writer queue would skip them (and the hits)
    for tokens in prompts:
        cache.lookup(tokens)
        cache.retrieve(tokens + [7] * 16)
        disk.flush()
    return cache


def test_a_working_cache_exposes_only_declared_series_with_their_help_type_and_labels(tmp_path, declarations):
    cache = used_cache(tmp_path)
    try:
        text = cache.metrics.render_prometheus()
    finally:
        cache.close()
    seen = set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # prometheus-client's creation timestamps, which the 0.0.4 parser reads as families of their own
        name = family.name + "_total" if family.type == "counter" else family.name
        decl = declarations[name]
        assert (family.type, family.documentation) == (decl.kind, decl.help)
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(decl.labels), sample
        seen.add(name)
    assert {"kvtier_hit_tokens_total", "kvtier_evictions_total", "kvtier_demotions_total",
            "kvtier_promotions_total", "kvtier_disk_write_queue", "kvtier_tier_entries"} <= seen
