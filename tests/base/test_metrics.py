"""Metrics on prometheus-client: kvtier's API unchanged, one registry per object, declared names, valid text.

The suite runs strict (tests/conftest.py): an undeclared name raises. Declarations: tests/base/test_metric_decls.py."""

from __future__ import annotations

import threading
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.metrics import STRICT_ENV, MetricKind, Metrics, MetricsServer

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)

#: Every family a cache with a memory tier exposes after a store, lookup and retrieve, with its type.
CACHE_FAMILIES = {
    "kvtier_lookups": "counter", "kvtier_lookup_tokens": "counter", "kvtier_hit_tokens": "counter",
    "kvtier_miss_tokens": "counter", "kvtier_stored_tokens": "counter", "kvtier_written_bytes": "counter",
    "kvtier_read_bytes": "counter", "kvtier_lookup_seconds": "histogram", "kvtier_store_seconds": "histogram",
    "kvtier_retrieve_seconds": "histogram", "kvtier_tier_used_bytes": "gauge",
    "kvtier_tier_capacity_bytes": "gauge", "kvtier_tier_entries": "gauge",
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def used_cache() -> KVCache:
    cache = KVCache(SPEC, "m@1", CacheConfig(chunk_size=16, tiers=[{"kind": "memory", "capacity_bytes": "1MiB"}]))
    tokens = list(range(64))
    cache.store(tokens, torch.zeros(SPEC.chunk_shape(64), dtype=SPEC.dtype))
    cache.lookup(tokens)
    cache.retrieve(tokens + [7] * 16)
    return cache


def test_a_cache_exposes_every_family_with_its_type_and_labels():
    cache = used_cache()
    parsed = families(cache.metrics.render_prometheus())
    assert {name: parsed[name].type for name in CACHE_FAMILIES} == CACHE_FAMILIES
    hits = [s for s in parsed["kvtier_hit_tokens"].samples if s.name == "kvtier_hit_tokens_total"]
    assert [(s.labels, s.value) for s in hits] == [({"tier": "memory"}, 64.0)]
    assert parsed["kvtier_hit_tokens"].documentation == "Tokens retrieved, by the tier that served them."


def test_python_reads_stay_simple():
    m = used_cache().metrics
    assert m.get("kvtier_hit_tokens_total", tier="memory") == 64
    assert m.get("kvtier_hit_tokens_total", tier="disk") == 0  # never counted: 0, not an error
    assert m.get("kvtier_miss_tokens_total") == 16
    assert m.get("kvtier_lookup_seconds") == 1  # a histogram's observation count
    assert m.total("kvtier_stored_tokens_total") == 64
    assert m.get("kvtier_evictions_total", tier="memory") == 0  # declared, never counted: 0
    snap = m.snapshot()
    assert snap['kvtier_hit_tokens_total{tier="memory"}'] == 64
    assert snap['kvtier_tier_entries{tier="memory"}'] == 4
    assert snap['kvtier_retrieve_seconds_bucket{le="+Inf"}'] == 1
    assert not any("_created" in k for k in snap)


def test_each_metrics_object_has_its_own_registry():
    a, b = Metrics(), Metrics()
    a.inc("kvtier_lookups_total", 3)
    b.inc("kvtier_lookups_total")
    assert a.registry is not b.registry
    assert (a.get("kvtier_lookups_total"), b.get("kvtier_lookups_total")) == (3, 1)
    assert "kvtier_lookups_total 3.0" in a.render_prometheus()
    assert "kvtier_lookups_total 1.0" in b.render_prometheus()


@pytest.fixture
def production(monkeypatch):
    """Metrics as in production: undeclared names are logged and counted, not raised."""
    monkeypatch.delenv(STRICT_ENV, raising=False)


def test_in_production_an_undeclared_name_reads_zero(production):
    m = used_cache().metrics
    assert m.get("kvtier_never_seen_total") == 0 and m.total("kvtier_never_seen_total") == 0
    assert m.get("kvtier_undeclared_metric_total", name="kvtier_never_seen_total") == 1  # once per name


def test_in_production_undeclared_names_are_recorded_as_before_and_counted(production, caplog):
    m = Metrics()
    m.inc("kvtier_peer_fetches_total", 2, peer="a")
    m.inc("kvtier_queue_depth", 5)  # not *_total: a gauge that keeps its exact name
    m.observe("kvtier_peer_fetch_seconds", 0.003, peer="a")
    m.add_gauges(lambda: iter([("kvtier_tier_entries", {"tier": "a"}, 1.0)]))
    m.add_gauges(lambda: iter([("kvtier_tier_entries", {"tier": "b"}, 2.0)]))
    parsed = families(m.render_prometheus())
    assert parsed["kvtier_peer_fetches"].type == "counter"
    assert parsed["kvtier_queue_depth"].type == "gauge"
    assert parsed["kvtier_peer_fetch_seconds"].type == "histogram"
    assert {s.labels["tier"]: s.value for s in parsed["kvtier_tier_entries"].samples} == {"a": 1.0, "b": 2.0}
    assert m.get("kvtier_peer_fetches_total", peer="a") == 2
    assert m.get("kvtier_peer_fetch_seconds", peer="a") == 1
    assert sorted(n for n, _, _ in m.samples(MetricKind.GAUGE)) == ["kvtier_queue_depth", "kvtier_tier_entries",
                                                                    "kvtier_tier_entries"]
    undeclared = {k: v for k, v in m.snapshot().items() if k.startswith("kvtier_undeclared_metric_total")}
    assert undeclared == {'kvtier_undeclared_metric_total{name="kvtier_peer_fetches_total"}': 1.0,
                          'kvtier_undeclared_metric_total{name="kvtier_queue_depth"}': 1.0,
                          'kvtier_undeclared_metric_total{name="kvtier_peer_fetch_seconds"}': 1.0}
    m.inc("kvtier_peer_fetches_total", peer="b")
    warned = [r.getMessage() for r in caplog.records if "kvtier_peer_fetches_total" in r.getMessage()]
    assert len(warned) == 1 and "is not declared" in warned[0]  # logged and counted once per name
    assert m.get("kvtier_undeclared_metric_total", name="kvtier_peer_fetches_total") == 1
    assert m.get("kvtier_peer_fetches_total", peer="b") == 1


def test_in_strict_mode_an_undeclared_name_raises_wherever_it_is_used():
    m = Metrics()
    for use in (lambda: m.inc("kvtier_hit_token_total", 1, tier="memory"),  # a typo: no longer a new series
                lambda: m.observe("kvtier_lookup_second", 0.1), lambda: m.get("kvtier_never_seen_total"),
                lambda: m.total("kvtier_never_seen_total")):
        with pytest.raises(ValueError, match="is not declared"):
            use()
    assert m.snapshot() == {}  # nothing was created under the misspelt names
    m.add_gauges(lambda: iter([("kvtier_tier_entrys", {"tier": "a"}, 1.0)]))
    with pytest.raises(ValueError, match="kvtier_tier_entrys is not declared"):
        m.render_prometheus()


def test_in_strict_mode_a_gauge_callback_must_match_its_declaration():
    m = Metrics()
    m.add_gauges(lambda: iter([("kvtier_tier_entries", {"tier": "a", "node": "x"}, 1.0)]))
    with pytest.raises(ValueError, match=r"labels \['tier'\], not yielded as a gauge with labels \['node', 'tier'\]"):
        m.snapshot()


def test_labels_must_match_the_declaration_from_the_first_use():
    m = Metrics()
    with pytest.raises(ValueError, match=r"labels \['tier'\], not \['reason', 'tier'\]"):
        m.inc("kvtier_evictions_total", tier="memory", reason="full")
    with pytest.raises(ValueError, match=r"labels \['tier'\], not \[\]"):
        m.inc("kvtier_hit_tokens_total", 16)
    with pytest.raises(ValueError, match="is a histogram, not a counter or gauge"):
        m.inc("kvtier_lookup_seconds")


def test_a_declaration_records_like_its_name():
    from kvtier.core.metrics import HIT_TOKENS, RETRIEVE_SECONDS

    m = Metrics()
    m.inc(HIT_TOKENS, 16, tier="memory")
    m.inc("kvtier_hit_tokens_total", 16, tier="memory")
    with m.timer(RETRIEVE_SECONDS):
        pass
    assert m.get(HIT_TOKENS, tier="memory") == m.get("kvtier_hit_tokens_total", tier="memory") == 32
    assert m.total(HIT_TOKENS) == 32 and m.get(RETRIEVE_SECONDS) == 1


def test_a_name_keeps_its_label_names_and_its_kind():
    m = Metrics()
    m.inc("kvtier_evictions_total", tier="memory")
    with pytest.raises(ValueError, match=r"labels \['tier'\], not \['reason', 'tier'\]"):
        m.inc("kvtier_evictions_total", tier="memory", reason="full")
    with pytest.raises(ValueError, match="is a counter, not a histogram"):
        m.observe("kvtier_evictions_total", 1.0, tier="memory")


def test_concurrent_increments_are_all_counted():
    m = Metrics()

    def work():
        for _ in range(2000):
            m.inc("kvtier_written_bytes_total", 2, tier="memory")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.get("kvtier_written_bytes_total", tier="memory") == 8 * 2000 * 2


def test_metrics_server_serves_the_registry_over_http():
    cache = used_cache()
    server = MetricsServer(cache.metrics, 0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    finally:
        server.close()
    parsed = families(text)
    assert {name: parsed[name].type for name in CACHE_FAMILIES} == CACHE_FAMILIES
