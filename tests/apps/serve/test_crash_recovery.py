"""Real ``kvtier serve`` processes over real HTTP: one request cannot kill the engine, and a crash keeps who owns
what on disk.

* A ``cache_ttl_s`` no tier can hold (1e308) on a server with a real redis-server tier is a 400, and the server
  goes on serving: the Redis tier once raised OverflowError into the engine thread, after which every request
  hung while ``/health`` said ok.
* A server with a disk tier killed with SIGKILL comes back with the owners and expiries of the chunks stored
  before the kill, so the tenant's clear still finds them.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from kvtier.api.tenants import tenant_salt
from kvtier.tiers.control import tenant_tag
from tests.apps.route.fleet import ReplicaProcess
from tests.apps.serve.conftest import WORDS
from tests.harness import wait_for
from tests.redis_server import RedisServer, have_redis_server

PROMPT = " ".join(WORDS * 2)  # several 16-token chunks
ADMIN, ALICE = "admin-secret", "alice-key"


def _replica(tmp_path: Path, model: Path, tiers_yaml: str, *extra: str) -> ReplicaProcess:
    config = tmp_path / "kvtier.yaml"
    config.write_text(f"chunk_size: 16\ntiers:\n{tiers_yaml}")
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN)
    key_file.chmod(0o600)
    return ReplicaProcess(model, tmp_path, "--config", str(config), "--admin-key-file", str(key_file), "--no-events",
                          *extra)


def _complete(url: str, prompt: str, key: str | None = None, **fields) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, **fields}, headers=headers,
                      timeout=60)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not have_redis_server(), reason="needs redis-server (scripts/setup.sh test installs it)")
def test_a_ttl_no_tier_can_hold_is_a_400_and_the_next_request_is_served(tmp_path, tiny_model_dir):
    with RedisServer() as redis:
        replica = _replica(tmp_path, tiny_model_dir, f"  - {{kind: redis, url: '{redis.url}'}}\n").start()
        try:
            replica.wait_healthy()
            refused = _complete(replica.url, PROMPT, cache_ttl_s=1e308)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_ttl_s", refused.text
            served = _complete(replica.url, PROMPT, cache_ttl_s=3600)  # stored in Redis with a retention time
            assert served.status_code == 200, served.text
            again = _complete(replica.url, PROMPT)
            assert again.status_code == 200 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            health = httpx.get(replica.url + "/health", timeout=10)
            assert health.status_code == 200 and health.json()["status"] == "ok", health.text
            assert health.json()["in_flight"] == 0
        finally:
            replica.stop()
        assert replica.proc.returncode == -signal.SIGTERM  # SIGTERM still ends it (not SIGKILL after 30 s)


@pytest.mark.timeout(600)
def test_after_a_sigkill_a_tenants_chunks_are_still_its_own_and_its_clear_finds_them(tmp_path, tiny_model_dir):
    disk = tmp_path / "disk"
    tiers = f"  - {{kind: disk, path: '{disk}', capacity_bytes: 64MiB}}\n"
    replica = _replica(tmp_path, tiny_model_dir, tiers).start()
    other = "rivers " + PROMPT  # the default tenant's
    try:
        replica.wait_healthy()
        assert _complete(replica.url, PROMPT, ALICE, cache_ttl_s=3600).status_code == 200
        assert _complete(replica.url, other).status_code == 200
        assert wait_for(lambda: _cached(replica.url, PROMPT, ALICE) > 0 and _cached(replica.url, other) > 0,
                        timeout=30)  # written by the disk tier's background writers
        replica.stop(signal.SIGKILL)  # no clean close: nothing is written at exit
        replica.start()
        replica.wait_healthy()
        assert _cached(replica.url, PROMPT, ALICE) > 0 and _cached(replica.url, other) > 0
        cleared = httpx.post(replica.url + "/admin/v1/clear", json={}, headers=_bearer(ALICE), timeout=30)
        assert cleared.status_code == 200, cleared.text
        assert _cached(replica.url, PROMPT, ALICE) == 0  # alice's chunks were still alice's: all gone
        assert _cached(replica.url, other) > 0  # the default tenant's stay
        tag = tenant_tag(tenant_salt(ALICE))
        assert not any(f".{tag}." in p.name for p in disk.glob("*/??/*"))
    finally:
        replica.stop()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _cached(url: str, prompt: str, key: str | None = None) -> int:
    """Cached tokens of ``prompt`` for the tenant of ``key`` (None: the default tenant, asked as the admin)."""
    body = {"text": prompt} if key else {"text": prompt, "tenant": "default"}
    answer = httpx.post(url + "/admin/v1/lookup", json=body, headers=_bearer(key or ADMIN), timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["cached_tokens"]
