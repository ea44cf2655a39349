"""Outputs never change: vLLM with and without kvtier, greedy, token for token, under concurrency and faults.

Nine prompts of 296 tokens, three by three sharing a 256-token prefix (four 64-token chunks), run together
(up to 32 output tokens). Engines (each in its own interpreter, tests/integrations/vllm_engine.py):

* ``base``: vLLM alone;
* ``async``: kvtier's default asynchronous loads over memory + disk, in-process so faults can be injected: a
  chunk deleted between lookup and load, a corrupt chunk, a tier slower than the load deadline, requests
  aborted while their loads run;
* ``restart``: a new process over the disk tier ``async`` left, with a KV cache so small vLLM preempts;
* ``sync``: ``load_mode: "sync"`` in vLLM's default two-process layout;
* ``stream``: vLLM's own prefix cache off, so a hit can only come from kvtier: a request that arrives while
  another one with the same prefix decodes;
* ``exit``: the engine shut down while loads run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm_model import build_tiny_llama, prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK, PREFIX = 64, 256
PREFIXES = [prompt_ids(10 + i, PREFIX) for i in range(3)]
PROMPTS = [PREFIXES[i % 3] + prompt_ids(100 + i, 40) for i in range(9)]
MAX_TOKENS = 32
HIT = 'kvtier_hit_tokens_total{tier="memory"}'


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm-async")
    build_tiny_llama(path / "model")
    return path


def run_engine(workdir: Path, name: str, kvtier: dict | None, steps: list[str], *, in_process: bool = True,
               prompts: list[list[int]] = PROMPTS, **spec_extra) -> dict:
    spec = {"model": str(workdir / "model"), "prompts": prompts, "steps": steps, "kvtier": kvtier,
            "max_tokens": MAX_TOKENS, **spec_extra}
    proc, out_path = run_engine_spec(workdir, name, spec, in_process=in_process)
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    out = json.loads(out_path.read_text())
    out["stderr"] = proc.stderr
    return out


def tiers(workdir: Path, **extra) -> dict:
    disk = {"kind": "disk", "path": str(workdir / "disk-tier"), "capacity_bytes": "256MiB",
            "admission": "always"}  # a later engine reads what the first stored once
    return {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}, disk], **extra}


def tokens(outputs: list[dict]) -> list[list[int]]:
    return [o["tokens"] for o in outputs]


def cached(outputs: list[dict]) -> list[int]:
    return [o["cached"] for o in outputs]


@pytest.fixture(scope="module")
def baseline(workdir) -> list[dict]:
    return run_engine(workdir, "base", None, ["gen:base"])["base"]


@pytest.fixture(scope="module")
def async_run(workdir) -> dict:
    steps = ["gen:cold", "reset", "metrics:m0", "gen:warm", "metrics:m1",
             "reset", "evict:0:2", "gen:evicted",
             "reset", "corrupt:4:1", "gen:corrupt",
             "reset", "slow:3", "gen:late", "slow:0",
             "reset", "slow:1", "abort:aborted", "slow:0", "gen:after_abort", "loads:loads"]
    return run_engine(workdir, "async", tiers(workdir, load_timeout_s=1.5), steps)


def test_async_outputs_identical_under_concurrency_and_faults(baseline, async_run):
    assert all(len(t) == MAX_TOKENS for t in tokens(baseline))
    for label in ("cold", "warm", "evicted", "corrupt", "late", "after_abort"):
        assert tokens(async_run[label]) == tokens(baseline), label


def test_requests_sharing_a_prefix_load_it_once(async_run):
    # vLLM's prefix cache was reset: each prompt's 256 prefix tokens came through kvtier, but the second and
    # third prompt of a prefix waited for the first one's load and then hit vLLM's own cache.
    assert cached(async_run["warm"]) == [PREFIX] * 9
    assert async_run["m1"][HIT] - async_run["m0"].get(HIT, 0) == 3 * PREFIX


def test_failed_loads_are_reported_and_recomputed(async_run):
    loads = async_run["loads"]
    assert loads["deadline"] >= 1  # a tier slower than load_timeout_s: the load was cut short
    assert loads["aborted"] + loads["deadline"] >= 2
    assert loads["failed_blocks"] > 0
    # (vLLM's num_cached_tokens counts what was promised at scheduling time, failed blocks included; the
    # deleted and corrupt chunks show in failed_blocks and in outputs that stay identical)


def test_abort_while_loading(async_run):
    assert async_run["aborted"]["loading_when_aborted"] >= 1


@pytest.fixture(scope="module")
def restart_run(workdir, async_run) -> dict:
    """21 blocks of 32 tokens: two 296-token prompts fit, and at 320 tokens one of them must be preempted."""
    steps = ["gen:restart", "preemptions:p1", "reset", "gen:warm", "preemptions:p2"]
    return run_engine(workdir, "restart", tiers(workdir), steps, num_blocks=21, max_model_len=640)


def test_restart_over_disk_and_preemption_keep_outputs(baseline, restart_run):
    assert restart_run["p1"] > 0 and restart_run["p2"] > restart_run["p1"]
    assert tokens(restart_run["restart"]) == tokens(baseline)
    assert tokens(restart_run["warm"]) == tokens(baseline)
    assert max(cached(restart_run["restart"])) == PREFIX  # the new process hit what the first one stored


def test_sync_loads_keep_outputs(workdir, baseline):
    run = run_engine(workdir, "sync", tiers(workdir, load_mode="sync"), ["gen:cold", "reset", "gen:warm"],
                     in_process=False)
    assert tokens(run["cold"]) == tokens(baseline)
    assert tokens(run["warm"]) == tokens(baseline)
    assert cached(run["warm"]) == [PREFIX] * 9


def test_request_arriving_while_another_decodes_hits_its_prompt_chunks(workdir, baseline):
    """vLLM's prefix cache off: prompt 3's prefix can only come from kvtier, saved while prompt 0 decodes."""
    memory_only = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]}
    run = run_engine(workdir, "stream", memory_only, ["stream:s"], prompts=[PROMPTS[0], PROMPTS[3]],
                     prefix_caching=False)
    assert tokens(run["s"]) == [baseline[0]["tokens"], baseline[3]["tokens"]]
    assert cached(run["s"]) == [0, PREFIX]


def test_engine_shuts_down_cleanly_mid_load(workdir, async_run):
    run = run_engine(workdir, "exit", tiers(workdir), ["slow:5", "exit"])
    assert run["loading_at_exit"] >= 1
    # no error of kvtier's at shutdown (llvmlite's finalizers may print their own at interpreter exit)
    assert "kvtier/integrations/vllm" not in run["stderr"] and "kvtier: loading request" not in run["stderr"]
