"""Inputs beside token ids on vLLM (CPU): a repeated prompt given as embeddings and a repeated image prompt, kvtier
vs vLLM alone, and what keying the embeddings and the image costs.

Two OpenAI servers of SmolLM2-135M-Instruct (float32, blocks of 32, ``--enable-prompt-embeds``): vLLM alone and
vLLM with ``KVTierConnector`` (memory tier, chunks of 256). The prompt is ``--positions`` rows of the model's
embedding matrix for random token ids, sent as ``prompt_embeds``. Before every timed request vLLM's own prefix
cache is reset (``/reset_prefix_cache``), so vLLM alone recomputes the prompt and kvtier serves it (it ran once
before the timings). TTFT is the wall time of a ``max_tokens=1`` completion, the median of ``--repeats``; the
servers answer one request at a time.

The digest: the connector's scheduler keys a prompt-embeddings request by a BLAKE3 digest of each chunk's embedding
bytes, once per request (``kvtier.integrations.vllm.inputs.request_extras`` on vLLM's own ``Request``), in the
scheduler's loop. Its cost is timed here on a request with the same tensor, the median of 20, as a share of the
kvtier TTFT (the smaller TTFT, so the larger share); the limit is 2%.

The image rows: the same two servers, of a model of SmolVLM-256M's shape (``tests/integrations/vlm_model.py``:
its SigLIP vision tower with random weights over SmolLM2-135M-Instruct's text model; one 512x512 image is 67
placeholder tokens, without SmolVLM's image splitting), a chat prompt of a random image followed by
``--image-words`` words of text. A hit on kvtier covers the image's placeholders, so vLLM skips the vision tower
too, as its own prefix cache would. The image's keying cost is what kvtier adds to a request's chunk hashing: reading
its multimodal inputs (``request_extras``) and folding the image's hash into the chunks it overlaps, timed on
vLLM's ``Request`` with the prompt's token ids and placeholder range (vLLM hashes the image bytes itself, for its
own cache, whether kvtier runs or not), as a share of the kvtier TTFT; the limit is 2%.

    python benchmarks/vllm_inputs.py [--positions 2048] [--image-words 1200] [--repeats 5]

The last line is ``RESULT {json}``: for each input (``embeds_*``, ``image_*``) both TTFTs, the speed-up, the
digest's share and whether it is under the limit, the tokens kvtier loaded per repeat, and whether the first
tokens matched vLLM alone's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from _util import result, stop_children_on_signal  # noqa: E402

from kvtier.net.ports import free_port  # noqa: E402
from tests.integrations.vllm_inputs import embedding_matrix, encode_embeds, random_embeds  # noqa: E402
from tests.integrations.vllm_server import VllmServer  # noqa: E402
from tests.integrations.vlm_model import SMOLVLM, build_vlm, image_url  # noqa: E402

CHUNK = 256
DIGEST_LIMIT = 0.02
NAME = "smollm2"
ARGS = ("--served-model-name", NAME, "--block-size", "32", "--max-model-len", "4096", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--max-num-seqs", "4")
EMBEDS_ARGS = (*ARGS, "--enable-prompt-embeds")
IMAGE_ARGS = (*ARGS, "--limit-mm-per-prompt", '{"image": 1}')
WORDS = "river stone lamp orchard violet engine harbor copper meadow signal winter pepper canyon ribbon".split()


def ttft(server: VllmServer, payload: str) -> tuple[float, list[int]]:
    """Seconds to the first token of a greedy one-token completion, and its token ids."""
    body = {"model": NAME, "prompt_embeds": payload, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    start = time.perf_counter()
    out = server.post("/v1/completions", body, timeout=600)
    return time.perf_counter() - start, list(out["choices"][0]["token_ids"])


def image_prompt(words: int) -> list[dict]:
    """A chat prompt: one random image, then ``words`` random words of text."""
    rng = random.Random(5)
    text = "Read the picture and the page below, then continue the page.\n\n" + " ".join(
        rng.choice(WORDS) for _ in range(words))
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(0, SMOLVLM.image_size)}},
                                         {"type": "text", "text": text}]}]


def chat_ttft(server: VllmServer, messages: list[dict]) -> tuple[float, list[int]]:
    """Seconds to the first token of a greedy one-token chat completion, and its token ids."""
    body = {"model": NAME, "messages": messages, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    start = time.perf_counter()
    out = server.post("/v1/chat/completions", body, timeout=600)
    return time.perf_counter() - start, list(out["choices"][0]["token_ids"])


def hits(server: VllmServer) -> float:
    return server.metrics().get("kvtier_hit_tokens_total{memory}", 0.0)


def timed_repeats(server: VllmServer, send, repeats: int) -> tuple[float, list[int], float]:
    """Median TTFT of ``send(server)`` over ``repeats`` requests each after a prefix-cache reset, the first answer,
    and the kvtier tokens loaded per request (0 for vLLM alone)."""
    times, answer, before = [], None, hits(server)
    for _ in range(repeats):
        server.reset_prefix_cache()
        seconds, tokens = send(server)
        times.append(seconds)
        answer = answer or tokens
    time.sleep(1.0)  # the last request's counters travel with a later step's output: one more step brings them
    send(server)
    loaded = (hits(server) - before) / (repeats + 1)
    return statistics.median(times), answer or [], loaded


def digest_seconds(embeds, runs: int = 20) -> float:
    """Median time of keying a prompt-embeddings request as the connector's scheduler does."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvtier.integrations.vllm.inputs import request_extras

    times = []
    for i in range(runs):
        request = Request(f"r{i}", None, SamplingParams(max_tokens=1), None, prompt_embeds=embeds)
        start = time.perf_counter()
        request_extras(request, CHUNK)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def image_key_seconds(prompt: list[int], offset: int, runs: int = 20) -> float:
    """Median time kvtier adds to keying an image request: reading its inputs and folding the image's hash into
    the chunk hashes, less the same hashing without it."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    from kvtier.base.keys import ChunkHash, chunk_hashes
    from kvtier.integrations.vllm.inputs import request_extras

    root = ChunkHash(hashlib.sha256(b"root").digest())
    place = PlaceholderRange(offset=offset, length=SMOLVLM.image_tokens)
    times = []
    for i in range(runs):
        image = MultiModalFeatureSpec(None, "image", hashlib.sha256(b"%d" % i).hexdigest(), place)
        request = Request(f"i{i}", prompt, SamplingParams(max_tokens=1), None, mm_features=[image])
        start = time.perf_counter()
        chunk_hashes(root, request.all_token_ids, CHUNK, request_extras(request, CHUNK))
        keyed = time.perf_counter() - start
        start = time.perf_counter()
        chunk_hashes(root, request.all_token_ids, CHUNK)
        times.append(keyed - (time.perf_counter() - start))
    return max(statistics.median(times), 0.0)


def pair(model: Path, args: tuple[str, ...], tmp: Path) -> tuple[VllmServer, VllmServer]:
    """vLLM alone and vLLM with kvtier (memory tier), started side by side."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "2GiB"}]}
    plain = VllmServer(str(model), free_port(), tmp / "plain.log", args=args, env=env)
    cached = VllmServer(str(model), free_port(), tmp / "kvtier.log", kvtier=kvtier, args=args, env=env)
    for server in (plain, cached):
        server.launch()
    try:
        for server in (plain, cached):
            server.wait_ready()
    except BaseException:
        plain.stop()
        cached.stop()
        raise
    return plain, cached


def compare(plain: VllmServer, cached: VllmServer, send, repeats: int) -> dict:
    """Both servers' TTFT of ``send`` after a warm-up (kvtier stores the prompt), then the servers stopped."""
    try:
        send(plain)  # warm-up: first-request costs out of the timings
        send(cached)  # and kvtier stores the prompt
        recompute, expected, _ = timed_repeats(plain, send, repeats)
        loaded_s, answer, loaded = timed_repeats(cached, send, repeats)
    finally:
        plain.stop()
        cached.stop()
    return {"ttft_vllm_alone_s": recompute, "ttft_kvtier_s": loaded_s, "speedup": recompute / loaded_s,
            "loaded_tokens_per_request": loaded, "outputs_equal": answer == expected}


def embeds_rows(args: argparse.Namespace, tmp: Path) -> dict:
    from kvtier.integrations.models import ensure_smollm2

    model = ensure_smollm2()
    embeds = random_embeds(embedding_matrix(model), 0, args.positions)
    payload = encode_embeds(embeds)
    row = compare(*pair(model, EMBEDS_ARGS, tmp), lambda server: ttft(server, payload), args.repeats)
    digest = digest_seconds(embeds)
    share = digest / row["ttft_kvtier_s"]
    print(f"{args.positions}-position prompt embeddings: vLLM alone {row['ttft_vllm_alone_s'] * 1e3:.0f} ms, "
          f"kvtier {row['ttft_kvtier_s'] * 1e3:.0f} ms ({row['speedup']:.2f}x), "
          f"{row['loaded_tokens_per_request']:.0f} tokens loaded per request; "
          f"digest {digest * 1e3:.2f} ms = {share:.2%} of kvtier's TTFT (limit {DIGEST_LIMIT:.0%})")
    return {"positions": args.positions, **row, "digest_s": digest, "digest_share_of_ttft": share,
            "digest_ok": share < DIGEST_LIMIT}


def image_rows(args: argparse.Namespace, tmp: Path) -> dict:
    model = build_vlm(tmp / "smolvlm-shape", SMOLVLM)
    messages = image_prompt(args.image_words)
    plain, cached = pair(model, IMAGE_ARGS, tmp)
    fake = plain.post("/tokenize", {"model": NAME, "prompt": "<fake_token_around_image>",
                                    "add_special_tokens": False})["tokens"][0]
    body = {"model": NAME, "messages": messages, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    prompt = plain.post("/v1/chat/completions", body, timeout=600)["prompt_token_ids"]
    row = compare(plain, cached, lambda server: chat_ttft(server, messages), args.repeats)
    digest = image_key_seconds(prompt, prompt.index(fake))
    share = digest / row["ttft_kvtier_s"]
    print(f"{len(prompt)}-token image prompt (one {SMOLVLM.image_size}px image): vLLM alone "
          f"{row['ttft_vllm_alone_s'] * 1e3:.0f} ms, kvtier {row['ttft_kvtier_s'] * 1e3:.0f} ms "
          f"({row['speedup']:.2f}x), {row['loaded_tokens_per_request']:.0f} tokens loaded per request; "
          f"image keying {digest * 1e6:.0f} us = {share:.3%} of kvtier's TTFT (limit {DIGEST_LIMIT:.0%})")
    return {"prompt_tokens": len(prompt), **row, "digest_us": digest * 1e6, "digest_share_of_ttft": share,
            "digest_ok": share < DIGEST_LIMIT}  # microseconds: the RESULT line rounds to 4 decimals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--image-words", type=int, default=1200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    stop_children_on_signal()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "embeds").mkdir()
        (Path(tmp) / "image").mkdir()
        embeds = embeds_rows(args, Path(tmp) / "embeds")
        image = image_rows(args, Path(tmp) / "image")
    result({**{f"embeds_{k}": v for k, v in embeds.items()}, **{f"image_{k}": v for k, v in image.items()},
            "digest_limit": DIGEST_LIMIT})


if __name__ == "__main__":
    main()
