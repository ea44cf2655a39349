"""A sliding-window model in vLLM's engine (in process) with the kvtier connector and vLLM's hybrid KV cache
manager on. A chunk that fails verification makes the whole load fail, and vLLM recomputes that request, with
the same tokens as vLLM alone (block ids are unique only within a KV cache group, so vLLM takes such a failure
per request, ``failed_recving``, not per block). Four requests in flight, loaded from kvtier, that outgrow a small
cache as they decode are preempted and still give vLLM alone's tokens."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from harness.window_model import build_tiny_gemma3  # noqa: E402
from tests.integrations.vllm_model import prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK = 128
NUM_BLOCKS = 100  # vLLM's cache, in blocks of its pool shared by every KV cache group (72 let it start here)


def test_a_corrupt_chunk_fails_the_load_and_vllm_recomputes_the_request(tmp_path) -> None:
    model = build_tiny_gemma3(tmp_path / "model", window=96)
    prompts = [prompt_ids(1, 600), prompt_ids(2, 300)]
    base = {"model": str(model), "prompts": prompts, "max_tokens": 12}
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]}
    proc, out = run_engine_spec(tmp_path, "plain", {**base, "kvtier": None, "steps": ["gen:cold"]}, in_process=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = [r["tokens"] for r in json.loads(out.read_text())["cold"]]
    steps = ["gen:cold", "reset", "gen:warm", "reset", "corrupt:0:1", "gen:corrupt"]
    proc, out = run_engine_spec(tmp_path, "kvtier", {**base, "kvtier": kvtier, "steps": steps}, in_process=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    for step in ("cold", "warm", "corrupt"):
        assert [r["tokens"] for r in got[step]] == expected, step
    assert [r["cached"] for r in got["warm"]] == [4 * CHUNK, 2 * CHUNK]
    # prompt 0's chunk 1 no longer verifies: its load fails whole and vLLM recomputes it (same tokens, above)
    assert "did not arrive verified" in proc.stderr
    assert got["corrupt"][1]["cached"] == 2 * CHUNK


def test_preemption_with_four_requests_in_flight_keeps_vllm_alones_tokens(tmp_path) -> None:
    """Four 300-token prompts in flight, each loading 256 tokens from kvtier and decoding 700, in a cache of 100
    blocks: two run at once, and their full-attention blocks (one more every 32 tokens) outgrow the cache, so vLLM
    preempts one (vLLM alone does too); every greedy answer is still vLLM alone's. (The connector promises a load
    only where it fits beside what the running requests decode into next, so it takes growth, not the loads
    themselves, to preempt here.)"""
    model = build_tiny_gemma3(tmp_path / "model", window=96)
    base = {"model": str(model), "prompts": [prompt_ids(20 + i, 300) for i in range(4)], "max_tokens": 700,
            "num_blocks": NUM_BLOCKS, "max_model_len": 1024, "max_num_batched_tokens": 128, "max_num_seqs": 4}
    proc, out = run_engine_spec(tmp_path, "plain", {**base, "kvtier": None, "steps": ["gen:cold"]}, in_process=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = [r["tokens"] for r in json.loads(out.read_text())["cold"]]
    steps = ["gen:cold", "preemptions:p0", "reset", "gen:warm", "preemptions:p1"]
    proc, out = run_engine_spec(tmp_path, "kvtier", {**base, "kvtier": kvtier_config(), "steps": steps},
                                in_process=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert [r["tokens"] for r in got["cold"]] == expected
    assert [r["tokens"] for r in got["warm"]] == expected
    assert got["p1"] > got["p0"], "no request was preempted in the warm pass: the test checks nothing of preemption"
    assert all(r["cached"] >= 2 * CHUNK for r in got["warm"]), [r["cached"] for r in got["warm"]]


def kvtier_config() -> dict:
    return {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]}
