"""Metric declarations: each metric declared once with help and labels, every name the code uses declared and
known where it is used, every declaring module listed by kvtier.metric_owners, and the series a working cache
exposes matching their declarations."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grimp
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
)
from kvtier.metric_owners import declared
from kvtier.tiers import DiskTierConfig, MemoryTierConfig, WriteMode

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
SOURCE = Path(kvtier.__file__).parent
#: A metric name in code: a string literal passed to a Metrics method, yielded by a gauge callback, or declared.
USE = re.compile(r'(?:\.(?:inc|observe|timer|get|total)\(|yield |declare_\w+\()\s*"(kvtier_\w+)"')
#: A metric declared in code: the declaring call and its name.
DECLARE = re.compile(r'declare_(?:counter|gauge|histogram)\(\s*"(kvtier_\w+)"')


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


def module_of(path: Path) -> str:
    return ".".join(("kvtier", *path.relative_to(SOURCE).with_suffix("").parts)).removesuffix(".__init__")


@pytest.fixture(scope="module")
def owners() -> dict[str, str]:
    """metric name -> the module that declares it, from the source."""
    return {name: module_of(path) for path in SOURCE.rglob("*.py") for name in DECLARE.findall(path.read_text())}


def test_metric_owners_imports_every_module_that_declares_a_metric(owners):
    graph = grimp.build_graph("kvtier")
    assert len(set(owners.values())) >= 8  # the scan finds the declaring modules
    missing = {m for m in owners.values()
               if not graph.direct_import_exists(importer="kvtier.metric_owners", imported=m)}
    assert missing == set(), "add these modules to kvtier/metric_owners.py"


def test_a_module_using_a_metric_by_name_imports_the_module_that_declares_it(owners):
    """The ground layer has no list of owners to import on a miss: the name must be declared before it is used."""
    graph = grimp.build_graph("kvtier")
    unknown = {}
    for path in SOURCE.rglob("*.py"):
        user = module_of(path)
        for name in set(USE.findall(path.read_text())):
            owner = owners[name]
            if owner != user and not graph.chain_exists(importer=user, imported=owner):
                unknown.setdefault(user, []).append(f"{name} (declared in {owner})")
    assert unknown == {}


def test_the_ground_layer_alone_knows_only_what_was_imported():
    code = ("from kvtier.base.metrics import declaration, declarations_so_far\n"
            "names = {d.name for d in declarations_so_far()}\n"
            "print('kvtier_undeclared_metric_total' in names, declaration('kvtier_router_requests_total'))\n"
            "import kvtier.apps.route.metrics\n"
            "print(declaration('kvtier_router_requests_total').kind)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "None", "counter"]


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
