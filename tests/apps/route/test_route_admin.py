"""The admin API through ``kvtier route`` in front of two real ``kvtier serve`` processes, and ``kvtier cache``
(the CLI, as a subprocess) against the router and a replica."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.apps.route.config import HealthConfig, RouterConfig
from harness.fleet import ROOT, LiveRouter, ReplicaProcess
from harness.serve import WORDS, build_tiny_model

pytestmark = pytest.mark.slow

ADMIN, ALICE, BOB = "fleet-admin-key", "alice-key", "bob-key"
PROMPT = " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(60))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[LiveRouter, list[ReplicaProcess], Path]]:
    base = tmp_path_factory.mktemp("admin-fleet")
    model = build_tiny_model(base / "model")
    key_file = base / "admin.key"
    key_file.write_text(ADMIN + "\n")
    replicas = [ReplicaProcess(model, base, "--admin-key-file", str(key_file)) for _ in range(2)]
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_healthy()
        config = RouterConfig(tuple(r.url for r in replicas), health=HealthConfig(interval_s=0.3, timeout_s=2.0))
        with LiveRouter(config, model) as live:
            yield live, replicas, base
    finally:
        for replica in replicas:
            replica.stop()


def as_(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def kvtier_cache(base: Path, key: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVTIER_ADMIN_KEY", None)
    extra: list[str] = []
    if key is not None:
        path = base / f"{key}.key"
        path.write_text(key + "\n")
        extra = ["--key-file", str(path)]
    return subprocess.run([sys.executable, "-m", "kvtier", "cache", *args, *extra], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def complete(url: str, key: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=as_(key), timeout=120)
    assert r.status_code == 200, r.text


def test_the_router_checks_keys_and_bodies_before_fanning_out(fleet):
    live, replicas, _ = fleet
    assert httpx.post(live.url + "/admin/v1/lookup", json={"text": "x"}).status_code == 401
    bad = httpx.post(live.url + "/admin/v1/lookup", content=b'{"text": 1}', headers=as_(ADMIN))
    assert bad.status_code == 400 and "replicas" not in bad.json()
    pin = httpx.post(live.url + "/admin/v1/pin", json={"text": "x"}, headers=as_(ALICE))
    assert pin.status_code == 403  # every replica refused a tenant key
    assert {a["status"] for a in pin.json()["replicas"].values()} == {403}
    doc = httpx.get(live.url + "/admin/v1/openapi.json").json()
    assert set(doc["paths"]) >= {"/admin/v1/lookup", "/admin/v1/pin", "/admin/v1/unpin", "/admin/v1/clear",
                                 "/admin/v1/stats"}


def test_lookup_per_replica_and_a_tenants_clear_through_the_cli(fleet):
    live, replicas, base = fleet
    complete(live.url, ALICE)
    complete(live.url, BOB)
    answer = httpx.post(live.url + "/admin/v1/lookup", json={"text": PROMPT}, headers=as_(ALICE), timeout=60)
    assert answer.status_code == 200
    merged = answer.json()
    assert set(merged["replicas"]) == {r.name for r in replicas}
    assert merged["best"]["cached_tokens"] > 0 and merged["best"]["replica"] in merged["replicas"]

    found = kvtier_cache(base, ALICE, "lookup", "--url", live.url, "--text", PROMPT)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["best"]["cached_tokens"] == merged["best"]["cached_tokens"]
    cleared = kvtier_cache(base, ALICE, "clear", "--url", live.url)
    assert cleared.returncode == 0, cleared.stderr
    after = kvtier_cache(base, ALICE, "lookup", "--url", live.url, "--text", PROMPT)
    assert json.loads(after.stdout)["best"]["cached_tokens"] == 0
    bob = kvtier_cache(base, BOB, "lookup", "--url", live.url, "--text", PROMPT)
    assert json.loads(bob.stdout)["best"]["cached_tokens"] > 0  # alice's clear left bob's entries


def test_the_cli_against_a_replica_stats_and_refusals(fleet):
    live, replicas, base = fleet
    stats = kvtier_cache(base, ADMIN, "stats", "--url", replicas[0].url)
    assert stats.returncode == 0, stats.stderr
    assert "memory" in json.loads(stats.stdout)["tiers"]
    refused = kvtier_cache(base, ALICE, "stats", "--url", replicas[0].url)
    assert refused.returncode == 1 and "403" in refused.stderr
    nokey = kvtier_cache(base, None, "pin", "--url", replicas[0].url, "--text", PROMPT)
    assert nokey.returncode == 1 and "401" in nokey.stderr
    usage = kvtier_cache(base, ADMIN, "lookup", "--url", replicas[0].url, "--tokens", "1,x")
    assert usage.returncode == 2
