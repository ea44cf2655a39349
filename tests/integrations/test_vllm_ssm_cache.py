"""An SSM hybrid (Granite-4.0-H shape) in vLLM's engine (in process) with the kvtier connector, vLLM's hybrid KV
cache manager on and its Mamba prefix-caching mode ``align``: a repeated prompt and one sharing a long prefix
load from kvtier (vLLM's own prefix cache reset, so the hit is kvtier's) the attention KV and the conv and SSM
state at the same chunk boundary, and give vLLM alone's tokens; from memory, from disk after a restart, and with a
corrupt stored state (a miss: recomputed, same tokens); four requests loading at once, and a corrupt attention
chunk.

vLLM's CPU build runs ``align`` only with ``max_num_batched_tokens`` equal to the Mamba block size
(docs/integrations/hybrid.md); vLLM raises the attention block size to that of the Mamba state's page (64 here).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from harness.hybrid_model import build_tiny_hybrid  # noqa: E402
from tests.integrations.vllm_model import prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK = 64  # the Mamba block size vLLM picks for this model
HMA_OFF = "Turning off hybrid kv cache manager"


def _spec(model, prompts, steps, kvtier) -> dict:
    return {"model": str(model), "prompts": prompts, "max_tokens": 8, "block_size": 32, "prefix_caching": True,
            "max_num_batched_tokens": CHUNK, "max_num_seqs": 4, "steps": steps, "kvtier": kvtier}


def _run(tmp_path, name, spec) -> tuple[dict, str]:
    proc, out = run_engine_spec(tmp_path, name, spec, in_process=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


def _prompts() -> list[list[int]]:
    """Prompts ending a few tokens after the boundary they hit at (256): this random model's greedy tokens depend on
    the Mamba state only for a few tokens (a zero state at 256 changes them at 258 tokens, not at 270)."""
    first = prompt_ids(1, 258)
    # the second shares 4 chunks with the first; the third, unrelated, reuses blocks the first held
    return [first, first[:256] + prompt_ids(2, 3), prompt_ids(3, 300)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_hybrid(tmp_path_factory.mktemp("granite") / "model")


@pytest.fixture(scope="module")
def expected(model, tmp_path_factory) -> list[list[int]]:
    """vLLM alone (HMA on, its prefix cache in align mode), each prompt computed cold."""
    got, _ = _run(tmp_path_factory.mktemp("plain"), "plain",
                  _spec(model, _prompts(), ["gen:a:0", "reset", "gen:b:1"], None))
    tokens = [got["a"][0]["tokens"], got["b"][0]["tokens"]]
    assert len(set(tokens[0])) > 1, "one token repeated: a useless comparison"
    return tokens


def test_hits_from_memory_restore_the_state_and_give_vllm_alone_tokens(tmp_path, model, expected) -> None:
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]}
    steps = ["gen:cold:0", "reset", "gen:other:2", "reset", "gen:warm:0", "reset", "gen:shared:1", "reset",
             "corrupt-state:0:4:ssm", "gen:corrupt:0", "metrics:m"]
    got, logs = _run(tmp_path, "memory", _spec(model, _prompts(), steps, kvtier))
    assert HMA_OFF not in logs and "served uncached" not in logs
    assert got["cold"][0]["tokens"] == expected[0] and got["cold"][0]["cached"] == 0
    # a repeat loads 4 chunks (its last token is computed: the boundary at 256 is the last one before it)
    assert got["warm"][0] == {"tokens": expected[0], "cached": 4 * CHUNK}
    assert got["shared"][0] == {"tokens": expected[1], "cached": 4 * CHUNK}
    # the SSM state at 256 no longer verifies: the load fails and vLLM recomputes the request
    assert got["corrupt"][0]["tokens"] == expected[0]
    assert "did not arrive verified" in logs
    metrics = got["m"]
    assert any(k.startswith("kvtier_state_snapshots_loaded_total") and v > 0 for k, v in metrics.items()), metrics


def test_hits_from_disk_after_a_restart(tmp_path, model, expected) -> None:
    """A fresh engine's state blocks hold nothing of the stored request: only a restored state continues it."""
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity_bytes":
                                              "64MiB", "fsync": False, "o_direct": False}]}
    first, _ = _run(tmp_path, "store", _spec(model, _prompts(), ["gen:cold:0"], kvtier))
    assert first["cold"][0] == {"tokens": expected[0], "cached": 0}
    got, _ = _run(tmp_path, "restart", _spec(model, _prompts(), ["gen:warm:0", "reset", "gen:shared:1"], kvtier))
    assert got["warm"][0] == {"tokens": expected[0], "cached": 4 * CHUNK}
    assert got["shared"][0] == {"tokens": expected[1], "cached": 4 * CHUNK}


IN_FLIGHT = [prompt_ids(20 + i, 258) for i in range(4)]  # four prompts, each ending 2 tokens past its boundary


def test_four_in_flight_and_a_corrupt_chunk_give_vllm_alone_tokens(tmp_path, model) -> None:
    """Four requests loading their state and KV at once; then a corrupt attention chunk (not the state): that
    request's load fails whole and vLLM recomputes it, the other three still load."""
    plain, _ = _run(tmp_path, "plain4", _spec(model, IN_FLIGHT, ["gen:cold"], None))
    expected = [r["tokens"] for r in plain["cold"]]
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]}
    steps = ["gen:cold", "reset", "gen:warm", "reset", "corrupt:0:1", "gen:corrupt"]
    got, logs = _run(tmp_path, "kvtier4", _spec(model, IN_FLIGHT, steps, kvtier))
    for step in ("cold", "warm", "corrupt"):
        assert [r["tokens"] for r in got[step]] == expected, step
    assert [r["cached"] for r in got["warm"]] == [4 * CHUNK] * 4
    assert [r["cached"] for r in got["corrupt"]] == [0] + [4 * CHUNK] * 3
    assert "did not arrive verified" in logs
