"""Asynchronous loads do not overfill vLLM's KV cache: a hit is promised only when the cache has room for the
request beside the loads already promised, so loads cause no preemption and no prefix is loaded twice.

vLLM admits an asynchronous load when the blocks of its prompt are free, and parks it in
``WAITING_FOR_REMOTE_KVS``. With several hits arriving together it parks as many as fit exactly; once their loads
land they all run, the first output token of each needs one more block, none is free, and vLLM preempts one of
them, which later loads its prefix again. Synchronous loads never did this (docs/benchmarks/vllm-serve.md).

Four prompts of 320 tokens (10 blocks of 32), each with its own 256-token prefix, in a cache of 30 usable blocks:
cold (nothing to load; vLLM computes them and kvtier stores them), then vLLM's prefix cache is emptied and they
run again, all loaded from kvtier's memory tier.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm_model import build_tiny_llama, prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK = 64
PROMPTS = [prompt_ids(200 + i, 256) + prompt_ids(300 + i, 64) for i in range(4)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("vllm-admission")
    build_tiny_llama(workdir / "model")
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]}
    steps = ["gen:cold", "reset", "preemptions:p0", "loads:l0", "gen:warm", "preemptions:p1", "loads:l1"]
    spec = {"model": str(workdir / "model"), "prompts": PROMPTS, "steps": steps, "kvtier": kvtier,
            "max_tokens": 8, "num_blocks": 31, "max_model_len": 512}
    proc, out_path = run_engine_spec(workdir, "admission", spec, in_process=True)
    assert proc.returncode == 0, f"engine failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out_path.read_text())


def test_loads_cause_no_preemption_and_no_prefix_loads_twice(run):
    assert run["p1"] - run["p0"] == 0, "vLLM preempted requests while kvtier's loads held the cache"
    loads = {k: run["l1"].get(k, 0) - run["l0"].get(k, 0) for k in set(run["l1"]) | set(run["l0"])}
    assert loads.get("done") == len(PROMPTS), f"each prompt loaded once: {loads}"
    assert loads.get("failed_blocks", 0) == 0
    assert [o["cached"] for o in run["warm"]] == [len(p) - 1 for p in PROMPTS]  # all but the last token loaded


def test_outputs_equal_vllms_own(run):
    assert [o["tokens"] for o in run["warm"]] == [o["tokens"] for o in run["cold"]]
