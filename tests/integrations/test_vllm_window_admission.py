"""The connector's admission of asynchronous loads under vLLM's hybrid KV cache manager (a sliding-window model in
vLLM's engine, in process): a load is promised only when vLLM's blocks, counted over every KV cache group as vLLM
counts them, hold it beside what the promised loads lack and the running requests decode into next.

Four 500-token prompts in flight, each loading 384 tokens (3 chunks) from kvtier's memory tier. Each needs 27
blocks parked (12 of the full-attention group, 3 in each of the 5 sliding-window groups) and 24 more to run; a
check counting one group's 16 blocks parked two loads in a cache of 76 blocks that then could not run, with
nothing running to give blocks back (the engine stepped empty forever), and let loads preempt requests in a cache
of 100 where vLLM alone preempts none."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from harness.window_model import build_tiny_gemma3  # noqa: E402
from tests.integrations.vllm_model import prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK = 128
#: far above the ~40 s either run takes on a loaded 2-core machine: a deadlocked engine fails, not hangs
TIMEOUT_S = 420
KVTIER = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]}


def _runs(tmp_path, num_blocks: int) -> tuple[dict, dict]:
    """vLLM alone's and vLLM + kvtier's runs of the four prompts (kvtier's: cold, then again from kvtier only)."""
    model = build_tiny_gemma3(tmp_path / "model", window=96)
    base = {"model": str(model), "prompts": [prompt_ids(20 + i, 500) for i in range(4)], "max_tokens": 60,
            "num_blocks": num_blocks, "max_model_len": 1024, "max_num_batched_tokens": 128, "max_num_seqs": 4}
    plain_steps = ["gen:cold", "preemptions:p0"]
    proc, out = run_engine_spec(tmp_path, "plain", {**base, "kvtier": None, "steps": plain_steps}, in_process=True,
                                timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    plain = json.loads(out.read_text())
    steps = ["gen:cold", "preemptions:p0", "reset", "gen:warm", "preemptions:p1"]
    proc, out = run_engine_spec(tmp_path, "kvtier", {**base, "kvtier": KVTIER, "steps": steps}, in_process=True,
                                timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return plain, json.loads(out.read_text())


def _tokens(run: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in run]


def test_loads_into_a_cache_too_small_for_two_of_them_finish_with_vllm_alones_tokens(tmp_path) -> None:
    """76 blocks (vLLM needs 72 to start): one load at a time fits, two parked together do not."""
    plain, kvtier = _runs(tmp_path, 76)
    assert _tokens(kvtier["cold"]) == _tokens(plain["cold"])
    assert _tokens(kvtier["warm"]) == _tokens(plain["cold"])
    assert [r["cached"] for r in kvtier["warm"]] == [3 * CHUNK] * 4  # every prompt still loaded from kvtier
    assert kvtier["p1"] - kvtier["p0"] <= plain["p0"] + 1, (kvtier, plain["p0"])


def test_loads_preempt_no_more_than_vllm_alone(tmp_path) -> None:
    """100 blocks: two loads fit at once, with the decode of the requests already running."""
    plain, kvtier = _runs(tmp_path, 100)
    assert _tokens(kvtier["warm"]) == _tokens(plain["cold"])
    assert [r["cached"] for r in kvtier["warm"]] == [3 * CHUNK] * 4
    # the warm pass alone: the cold one computes as vLLM alone does
    assert kvtier["p1"] - kvtier["p0"] <= plain["p0"] + 1, (kvtier, plain["p0"])
