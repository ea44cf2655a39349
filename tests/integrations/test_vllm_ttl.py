"""A retention time through vLLM's ``kv_transfer_params={"kvtier": {"ttl_s": ...}}``, against a real in-process
engine (a tiny random Llama, memory tier): a request's stores carry its TTL and expire (a kvtier miss after it,
same tokens), a long TTL keeps its entries, and a malformed one is ignored with a warning without failing the
request (its entries are stored without a retention time)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.net.ports import free_port  # noqa: E402
from tests.integrations.vllm_model import build_tiny_llama, prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [prompt_ids(21 + i, 128) for i in range(4)]  # two full chunks each
PARAMS = [{"kvtier": {"ttl_s": 1}}, {"kvtier": {"ttl_s": 3600}}, {"kvtier": {"ttl_s": -5}},
          {"kvtier": {"ttl_s": "soon"}}]
KEY = "ttl-admin-key"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    work = tmp_path_factory.mktemp("vllm-ttl")
    build_tiny_llama(work / "model")
    (work / "admin.key").write_text(KEY)
    kvtier = {"chunk_size": 64, "metrics_port": free_port(), "admin_key_file": str(work / "admin.key"),
              "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]}
    lookups = [["POST", "/admin/v1/lookup", {"tokens": p}, KEY] for p in PROMPTS]
    # the stores end before the reset returns; three seconds later the one-second TTL has passed
    spec = {"model": str(work / "model"), "prompts": PROMPTS, "kvtier": kvtier, "kv_transfer_params": PARAMS,
            "admin": {"stored": lookups, "later": lookups},
            "steps": ["gen:cold", "reset", "admin:stored", "sleep:3", "admin:later", "gen:again"]}
    proc, out = run_engine_spec(work, "ttl", spec, in_process=True)
    assert proc.returncode == 0, f"engine failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(Path(out).read_text()), proc.stderr


def test_a_requests_ttl_expires_its_entries_and_a_long_one_keeps_them(run) -> None:
    record, _ = run
    assert [a["json"]["cached_tokens"] for a in record["stored"]] == [128, 128, 128, 128]
    assert [a["json"]["cached_tokens"] for a in record["later"]] == [0, 128, 128, 128]
    # vLLM's own prefix cache was reset: only kvtier can hit, and the expired prompt is a miss
    assert [o["cached"] for o in record["again"]] == [0, 127, 127, 127]
    assert [o["tokens"] for o in record["again"]] == [o["tokens"] for o in record["cold"]]


def test_a_malformed_ttl_is_ignored_with_a_warning_and_the_request_runs(run) -> None:
    record, stderr = run
    assert all(len(o["tokens"]) == 8 for o in record["cold"])
    assert stderr.count("kv_transfer_params.kvtier.ttl_s must be a positive number") == 2
    assert "-5" in stderr and "'soon'" in stderr
