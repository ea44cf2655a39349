"""kvtier serve's /metrics over real HTTP: valid Prometheus text from the cache's own registry."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.apps.serve.test_http import chat


def test_metrics_endpoint_is_prometheus_text_with_server_and_cache_families(client):
    chat(client)
    chat(client)
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    parsed = {f.name: f for f in text_string_to_metric_families(response.text)}
    kinds = {name: parsed[name].type for name in (
        "kvtier_server_requests", "kvtier_server_ttft_seconds", "kvtier_server_queue_seconds",
        "kvtier_server_requests_in_flight", "kvtier_hit_tokens", "kvtier_retrieve_seconds", "kvtier_tier_used_bytes")}
    assert kinds == {"kvtier_server_requests": "counter", "kvtier_server_ttft_seconds": "histogram",
                     "kvtier_server_queue_seconds": "histogram", "kvtier_server_requests_in_flight": "gauge",
                     "kvtier_hit_tokens": "counter", "kvtier_retrieve_seconds": "histogram",
                     "kvtier_tier_used_bytes": "gauge"}
    requests = {tuple(sorted(s.labels.items())): s.value for s in parsed["kvtier_server_requests"].samples
                if s.name == "kvtier_server_requests_total"}
    assert requests == {(("endpoint", "chat"), ("status", "200")): 2.0}
    ttft_count = next(s.value for s in parsed["kvtier_server_ttft_seconds"].samples if s.name.endswith("_count"))
    assert ttft_count == 2
