"""KVTierConnector against real vLLM (CPU build) and a tiny random-weight Llama.

Each engine runs once per module, in its own interpreter (tests/integrations/vllm_engine.py), and every
test reads what the engines recorded. Block size 32, chunk size 64; prompts of 300, 256 and 100 tokens
(full chunks: 4, 4 and 1; the 256-token prompt is entirely cached, so vLLM still computes its last token).
Three engines: plain vLLM; vLLM with kvtier (memory, then disk) in vLLM's default two-process layout; and a
new engine process on the same disk directory, in-process so the test can damage a chunk in its memory tier.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.net.ports import free_port  # noqa: E402
from tests.integrations.vllm_model import build_tiny_llama, prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [prompt_ids(1, 300), prompt_ids(2, 256), prompt_ids(3, 100)]
CHUNK = 64
FULL_HITS = [256, 255, 64]  # whole chunks, minus the one token vLLM must compute


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm")
    build_tiny_llama(path / "model")
    return path


@pytest.fixture(scope="module")
def engine(workdir: Path):
    """``engine(name, kvtier_config, steps, in_process=False)``: run an engine once, return its record."""

    @cache
    def run(name: str, kvtier: str | None, steps: tuple[str, ...], in_process: bool = False,
            log_stats: bool = False, kv_events: bool = False) -> dict:
        spec = {"model": str(workdir / "model"), "prompts": PROMPTS, "steps": list(steps),
                "kvtier": None if kvtier is None else json.loads(kvtier), "log_stats": log_stats,
                "kv_events_port": free_port() if kv_events else None}
        proc, out_path = run_engine_spec(workdir, name, spec, in_process=in_process)
        assert proc.returncode == 0, f"engine {name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        return json.loads(out_path.read_text())

    return run


def kvtier_tiers(workdir: Path) -> str:
    """Memory first, then a disk directory (written through) that a later engine process reads."""
    disk = {"kind": "disk", "path": str(workdir / "disk-tier"), "capacity_bytes": "256MiB",
            "admission": "always"}  # a later engine reads what the first stored once
    return json.dumps({"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}, disk]})


@pytest.fixture(scope="module")
def baseline(engine) -> list[dict]:
    return engine("baseline", None, ("gen:base",), in_process=True)["base"]


@pytest.fixture(scope="module")
def with_kvtier(engine, workdir) -> dict:
    """Scheduler and worker in different processes (vLLM's default on CPU); vLLM's stats on, the worker
    serving its cache's metrics on a port of its own, and vLLM publishing KV events over ZMQ."""
    tiers = {**json.loads(kvtier_tiers(workdir)), "metrics_port": free_port()}
    steps = ("gen:cold", "reset", "events:tiers", "gen:warm", "reset", "gen:again", "prom:vllm", "scrape:worker")
    return engine("kvtier", json.dumps(tiers), steps, log_stats=True, kv_events=True)


def tokens(outputs: list[dict]) -> list[list[int]]:
    return [o["tokens"] for o in outputs]


def cached(outputs: list[dict]) -> list[int]:
    return [o["cached"] for o in outputs]


def test_greedy_outputs_identical_with_and_without_kvtier(baseline, with_kvtier):
    assert all(len(t) == 8 for t in tokens(baseline))
    for label in ("cold", "warm", "again"):
        assert tokens(with_kvtier[label]) == tokens(baseline), label


def test_repeated_prompt_loads_its_prefix_from_kvtier(with_kvtier):
    assert cached(with_kvtier["cold"]) == [0, 0, 0]
    # vLLM's own prefix cache was reset: every cached token came from kvtier.
    assert cached(with_kvtier["warm"]) == FULL_HITS
    assert cached(with_kvtier["again"]) == FULL_HITS


@pytest.fixture(scope="module")
def second_engine(engine, workdir, with_kvtier) -> dict:
    """A new engine process (started after with_kvtier's exited), worker in the engine process so the test
    can reach its cache. Its first prompts hit what the first engine stored on disk."""
    steps = ("gen:first", "reset", "metrics:m_before", "corrupt:0:1", "gen:after", "reset", "metrics:m_after",
             "gen:healed")
    return engine("second", kvtier_tiers(workdir), steps, in_process=True)


def test_new_engine_process_gets_hits_from_the_first_ones_prompts(baseline, second_engine):
    assert cached(second_engine["first"]) == FULL_HITS
    assert tokens(second_engine["first"]) == tokens(baseline)


def test_corrupt_chunk_is_recomputed_and_output_unchanged(baseline, second_engine):
    run = second_engine
    before, after = run["m_before"], run["m_after"]
    # Prompt 0's chunk 1 failed verification in the memory tier: counted, and only chunk 0 of that prompt was
    # loaded; vLLM recomputed the rest (its num_cached_tokens counts what was promised at scheduling time).
    assert after['kvtier_corrupt_chunks_total{tier="memory"}'] == 1
    hit = 'kvtier_hit_tokens_total{tier="memory"}'
    assert after[hit] - before.get(hit, 0) == CHUNK + 4 * CHUNK + CHUNK
    assert tokens(run["after"]) == tokens(baseline)
    # The corrupt chunk was dropped; the recomputed request stored it again, intact.
    assert cached(run["healed"]) == FULL_HITS
    assert tokens(run["healed"]) == tokens(baseline)


def test_cache_metrics_reach_vllms_prometheus_registry(with_kvtier, workdir):
    """The worker's counters and gauges travel through vLLM's stats channel to the process serving vLLM's
    /metrics, under vLLM's prefix with kvtier's names and labels plus vLLM's."""
    series = with_kvtier["vllm"]
    vllm_labels = f'engine="0",model_name="{workdir / "model"}"'
    memory = vllm_labels + ',tier="memory"'
    assert series[f"vllm:kvtier_hit_tokens_total{{{memory}}}"] >= 2 * (256 + 64)  # warm and again
    assert series[f"vllm:kvtier_tier_capacity_bytes{{{memory}}}"] == 64 << 20
    assert series[f"vllm:kvtier_lookups_total{{{vllm_labels}}}"] >= 6


def test_worker_serves_its_full_metrics_on_the_configured_port(with_kvtier):
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(with_kvtier["worker"])}
    assert families["kvtier_retrieve_seconds"].type == "histogram"
    assert families["kvtier_hit_tokens"].type == "counter"  # the parser names a counter without _total
    hits = {s.labels["tier"]: s.value for s in families["kvtier_hit_tokens"].samples if s.name.endswith("_total")}
    assert hits["memory"] > 0



def test_kvtier_tiers_reach_vllms_kv_event_stream(with_kvtier):
    """What kvtier stored reaches the KV events vLLM publishes, under the tier's medium (memory: CPU, disk:
    DISK by default): one block per kvtier chunk, carrying the chunk's tokens and chained to the chunk before
    it by its hash."""
    events = with_kvtier["tiers"]
    # the replica's own tiers carry no ownership: routers weight them by medium (shared stores carry kvtier's)
    assert events and all(e["type"] == "BlockStored" and e["ownership"] is None for e in events)
    for medium in ("CPU", "DISK"):
        stored = [e for e in events if e["medium"] == medium]
        assert all(e["block_size"] == CHUNK and len(e["tokens"]) == CHUNK * len(e["hashes"]) for e in stored)
        blocks = {h: e["tokens"][i * CHUNK:(i + 1) * CHUNK] for e in stored for i, h in enumerate(e["hashes"])}
        assert sorted(map(tuple, blocks.values())) == sorted(
            tuple(p[i * CHUNK:(i + 1) * CHUNK]) for p in PROMPTS for i in range(len(p) // CHUNK))
        assert all(len(bytes.fromhex(h)) == 32 for h in blocks)
        firsts = [e for e in stored if e["parent"] is None]  # chains start at each prompt's first chunk
        assert sorted(e["tokens"][:CHUNK] for e in firsts) == sorted(p[:CHUNK] for p in PROMPTS)
        assert all(e["parent"] in blocks for e in stored if e["parent"] is not None)
