"""Admission through a real server: a disk tier at ``second-hit`` behind ``kvtier serve``'s HTTP API."""

from __future__ import annotations

import random
import re
import time

import httpx

from harness.serve import WORDS, LiveServer


def start(model_dir, disk_dir) -> LiveServer:
    from kvtier.apps.serve.backend import Backend, ServerConfig
    from kvtier.core.config import CacheConfig

    cache = CacheConfig.from_dict({"chunk_size": 16, "tiers": [
        {"kind": "memory", "capacity_bytes": "32MiB", "prefault": False},
        {"kind": "disk", "path": str(disk_dir), "capacity_bytes": "64MiB", "o_direct": False, "fsync": False,
         "admission": "second-hit"}]})
    config = ServerConfig(model_path=model_dir, served_name="tiny", cache=cache, default_max_tokens=4)
    return LiveServer(Backend.from_config(config))


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    text = client.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def complete(client: httpx.Client, prompt: str) -> None:
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_second_hit_disk_keeps_out_one_shot_prompts_and_takes_a_repeated_one(tiny_model_dir, tmp_path):
    prompts = [" ".join(random.Random(i).sample(WORDS, len(WORDS))) for i in range(6)]
    with start(tiny_model_dir, tmp_path) as live, httpx.Client(base_url=live.url, timeout=60) as client:
        for prompt in prompts:
            complete(client, prompt)
        live.backend.cache.tiers[1].flush()
        assert metric(client, "kvtier_tier_entries", tier="disk") == 0
        assert metric(client, "kvtier_tier_entries", tier="memory") > 0
        assert metric(client, "kvtier_admission_refused_total", reason="unseen", tier="disk") > 0
        complete(client, prompts[0])  # the second request with this prompt
        live.backend.cache.tiers[1].flush()
        deadline = time.monotonic() + 30
        while metric(client, "kvtier_tier_entries", tier="disk") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(client, "kvtier_tier_entries", tier="disk") > 0
