"""A sliding-window model on vLLM's real OpenAI server with the kvtier connector and vLLM's hybrid KV cache manager
on: a tiny random-weight Gemma-3-shaped model (five sliding-window layers attending 96 tokens back, one
full-attention layer), prompts several times longer than the window.

vLLM alone and vLLM with ``KVTierConnector`` (memory and disk tiers, chunks of 128 tokens, blocks of 32) start
side by side, both with the hybrid manager on (vLLM's default). Every greedy answer must be token for token the
one vLLM alone gives: a repeated prompt served from kvtier's memory tier, four requests in flight sharing a
prefix, and after a restart the same prompt served from the disk tier.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from harness.process import wait_for
from harness.vllm_server import VllmServer
from harness.window_model import build_tiny_gemma3, words
from kvtier.net.ports import free_port

pytestmark = pytest.mark.slow
CHUNK = 128
WINDOW = 96
NAME = "gemma3-tiny"
ARGS = ("--served-model-name", NAME, "--block-size", "32", "--max-model-len", "2048", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--max-num-seqs", "8")
HMA_OFF = "Turning off hybrid kv cache manager"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("vllm-window")
    model = str(build_tiny_gemma3(tmp / "model", window=WINDOW))
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # serves /reset_prefix_cache
    # "always": a disk tier admits a chunk on its second sighting by default, and the restart's prompt runs once
    disk = {"kind": "disk", "path": str(tmp / "disk"), "capacity_bytes": "256MiB", "admission": "always"}
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "128MiB"}, disk]}
    plain = VllmServer(model, free_port(), tmp / "plain.log", args=ARGS, env=env)
    cached = VllmServer(model, free_port(), tmp / "kvtier.log", kvtier=kvtier, args=ARGS, env=env)
    # after a restart: the disk tier alone, so every hit is read back from disk
    restarted = VllmServer(model, free_port(), tmp / "restarted.log", args=ARGS, env=env,
                           kvtier={"chunk_size": CHUNK, "tiers": [disk]})
    try:
        for server in (plain, cached):
            server.launch()
        for server in (plain, cached):
            server.wait_ready()
        yield {"plain": plain, "kvtier": cached, "restarted": restarted}
    finally:
        for server in (plain, cached, restarted):
            server.stop()


def client(server: VllmServer):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)


def complete(server: VllmServer, prompt: str, max_tokens: int = 16) -> tuple[list[int], int]:
    """Greedy completion: (token ids, cached prompt tokens)."""
    resp = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             extra_body={"return_token_ids": True})
    details = resp.usage.prompt_tokens_details
    return list(resp.choices[0].token_ids), (details.cached_tokens or 0) if details else 0


def hits(server: VllmServer, tier: str) -> float:
    return server.metrics().get(f"kvtier_hit_tokens_total{{{tier}}}", 0.0)


LONG = words(1, 600)  # 600 tokens: four full chunks, each boundary with a window to restore


def test_the_hybrid_kv_cache_manager_stays_on(servers) -> None:
    assert complete(servers["kvtier"], words(9, 40), max_tokens=2)[0]
    for name in ("plain", "kvtier"):
        log = servers[name].log.read_text(errors="replace")
        assert HMA_OFF not in log, f"vLLM turned its hybrid manager off with {name}"
        # one KV cache group per layer kind and layer: five sliding-window groups and a full-attention one
        assert "kv cache group sizes (32, 32, 32, 32, 32, 32)" in log, f"{name}: not the hybrid manager's groups"


def test_repeated_prompt_loads_from_memory_with_the_same_tokens(servers) -> None:
    plain, cached = servers["plain"], servers["kvtier"]
    expected = complete(plain, LONG)[0]
    assert len(set(expected)) > 1, "the model's greedy answer is one token repeated: a useless check"
    assert complete(cached, LONG)[0] == expected
    cached.reset_prefix_cache()  # waits for kvtier's saves
    before = hits(cached, "memory")
    warm, cached_tokens = complete(cached, LONG)
    assert warm == expected
    assert cached_tokens >= 4 * CHUNK, f"{cached_tokens} prompt tokens cached, expected {4 * CHUNK}"
    assert wait_for(lambda: hits(cached, "memory") - before >= 4 * CHUNK, timeout=30), "no hit from kvtier"


def test_four_requests_in_flight_sharing_a_prefix_match_vllm_alone(servers) -> None:
    plain, cached = servers["plain"], servers["kvtier"]
    shared = words(2, 400)  # three full chunks
    prompts = [f"{shared} {words(10 + i, 150)}" for i in range(4)]
    expected = [complete(plain, p)[0] for p in prompts]
    complete(cached, prompts[0])
    cached.reset_prefix_cache()
    before = hits(cached, "memory")
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(cached, p), prompts))
    assert [tokens for tokens, _ in got] == expected
    # vLLM's own cache was empty: the shared prefix came from kvtier (for some requests through vLLM's cache,
    # once another request's load had filled it)
    assert all(cached_tokens >= 3 * CHUNK for _, cached_tokens in got), [c for _, c in got]
    assert wait_for(lambda: hits(cached, "memory") - before >= 4 * CHUNK, timeout=30), \
        "the requests in flight did not load the shared prefix from kvtier"


def test_after_a_restart_the_disk_tier_serves_the_same_tokens(servers) -> None:
    plain, cached, restarted = servers["plain"], servers["kvtier"], servers["restarted"]
    prompt = words(3, 500)
    expected = complete(plain, prompt)[0]
    assert complete(cached, prompt)[0] == expected
    cached.reset_prefix_cache()  # kvtier's saves are done: the disk tier holds the prompt (write-through)
    cached.stop()
    restarted.start()
    got, cached_tokens = complete(restarted, prompt)
    assert got == expected
    assert cached_tokens >= 3 * CHUNK
    assert wait_for(lambda: hits(restarted, "disk") >= 3 * CHUNK, timeout=30), "no hit from the disk tier"
    assert complete(restarted, LONG)[0] == complete(plain, LONG)[0]
