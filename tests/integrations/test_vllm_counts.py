"""kvtier's hit counter under vLLM counts each token loaded into vLLM's blocks once, and nothing else.

``kvtier_hit_tokens_total`` (the worker's counter, and ``vllm:kvtier_hit_tokens_total`` on vLLM's Prometheus
registry) is compared with the tokens the connector's asynchronous loads delivered (``AsyncLoads.totals``):

* a request whose first half vLLM's own prefix cache still holds loads only the second half from kvtier (the
  chunks vLLM holds are neither read nor counted);
* a load cut short by its deadline delivers nothing and counts nothing, even though its retrieve goes on
  reading the slow tier after vLLM was told.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm_model import build_tiny_llama, prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK, PREFIX = 64, 512
SHARED = prompt_ids(60, PREFIX)
#: prompt 0: the whole 512-token prefix (8 chunks) + 40 tokens; prompt 1: its first half + 40 other tokens
PROMPTS = [SHARED + prompt_ids(61, 40), SHARED[: PREFIX // 2] + prompt_ids(62, 40)]
HIT = 'kvtier_hit_tokens_total{tier="memory"}'


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("vllm-counts")
    build_tiny_llama(workdir / "model")
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}], "load_timeout_s": 1.0}
    steps = ["gen:cold:0", "reset", "metrics:m0", "loads:l0", "prom:p0",
             "gen:half:1", "gen:full:0", "metrics:m1", "loads:l1", "prom:p1",
             "reset", "slow:3", "gen:late:0", "slow:0", "sleep:4", "metrics:m2", "loads:l2"]
    spec = {"model": str(workdir / "model"), "prompts": PROMPTS, "steps": steps, "kvtier": kvtier,
            "max_tokens": 8, "log_stats": True}
    proc, out_path = run_engine_spec(workdir, "counts", spec, in_process=True)
    assert proc.returncode == 0, f"engine failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out_path.read_text())


def _grown(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def test_partial_local_hit_loads_and_counts_only_the_rest(run):
    half, full = run["half"][0], run["full"][0]
    assert half["cached"] == PREFIX // 2  # all from kvtier (vLLM's cache was reset)
    assert full["cached"] == PREFIX  # the first half from vLLM's cache, the second from kvtier
    assert full["tokens"] == run["cold"][0]["tokens"]
    loaded = _grown(run["l1"], run["l0"], "loaded_tokens")
    assert loaded == PREFIX // 2 + PREFIX // 2
    assert _grown(run["m1"], run["m0"], HIT) == loaded  # not PREFIX // 2 + PREFIX: the held half again


def test_vllm_prometheus_counter_matches_the_workers(run):
    (name,) = [k for k in run["p1"] if k.startswith("vllm:kvtier_hit_tokens_total") and 'tier="memory"' in k]
    assert _grown(run["p1"], run["p0"], name) == _grown(run["m1"], run["m0"], HIT)


def test_load_past_its_deadline_counts_nothing(run):
    assert run["late"][0]["tokens"] == run["cold"][0]["tokens"]
    assert _grown(run["l2"], run["l1"], "deadline") == 1
    assert _grown(run["l2"], run["l1"], "loaded_tokens") == 0
    assert _grown(run["m2"], run["m1"], HIT) == 0  # the retrieve finished reading after the load was closed
