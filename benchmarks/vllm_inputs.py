"""Inputs beside token ids on vLLM (CPU): a repeated prompt given as embeddings, kvtier vs vLLM alone, and what
keying the embeddings costs.

Two OpenAI servers of SmolLM2-135M-Instruct (float32, blocks of 32, ``--enable-prompt-embeds``): vLLM alone and
vLLM with ``KVTierConnector`` (memory tier, chunks of 256). The prompt is ``--positions`` rows of the model's
embedding matrix for random token ids, sent as ``prompt_embeds``. Before every timed request vLLM's own prefix
cache is reset (``/reset_prefix_cache``), so vLLM alone recomputes the prompt and kvtier serves it (it ran once
before the timings). TTFT is the wall time of a ``max_tokens=1`` completion, the median of ``--repeats``; the
servers answer one request at a time.

The digest: the connector's scheduler keys a prompt-embeddings request by a SHA-256 of each chunk's embedding
bytes, once per request (``kvtier.integrations.vllm.inputs.request_extras`` on vLLM's own ``Request``), in the
scheduler's loop. Its cost is timed here on a request with the same tensor, the median of 20, as a share of the
kvtier TTFT (the smaller TTFT, so the larger share); the limit is 2%.

    python benchmarks/vllm_inputs.py [--positions 2048] [--repeats 5]

The last line is ``RESULT {json}``: both TTFTs, the speed-up, the digest's share and whether it is under the
limit, the tokens kvtier loaded per repeat, and whether the first tokens matched vLLM alone's.
"""

from __future__ import annotations

import argparse
import os
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

CHUNK = 256
DIGEST_LIMIT = 0.02
NAME = "smollm2"
ARGS = ("--served-model-name", NAME, "--block-size", "32", "--max-model-len", "4096", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--max-num-seqs", "4", "--enable-prompt-embeds")


def ttft(server: VllmServer, payload: str) -> tuple[float, list[int]]:
    """Seconds to the first token of a greedy one-token completion, and its token ids."""
    body = {"model": NAME, "prompt_embeds": payload, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    start = time.perf_counter()
    out = server.post("/v1/completions", body, timeout=600)
    return time.perf_counter() - start, list(out["choices"][0]["token_ids"])


def hits(server: VllmServer) -> float:
    return server.metrics().get("kvtier_hit_tokens_total{memory}", 0.0)


def timed_repeats(server: VllmServer, payload: str, repeats: int) -> tuple[float, list[int], float]:
    """Median TTFT over ``repeats`` requests each after a prefix-cache reset, the first answer, and the kvtier
    tokens loaded per request (0 for vLLM alone)."""
    times, answer, before = [], None, hits(server)
    for _ in range(repeats):
        server.reset_prefix_cache()
        seconds, tokens = ttft(server, payload)
        times.append(seconds)
        answer = answer or tokens
    time.sleep(1.0)  # the last request's counters travel with a later step's output: one more step brings them
    ttft(server, payload)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    stop_children_on_signal()
    from kvtier.integrations.models import ensure_smollm2

    model = ensure_smollm2()
    embeds = random_embeds(embedding_matrix(model), 0, args.positions)
    payload = encode_embeds(embeds)
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "2GiB"}]}
    with tempfile.TemporaryDirectory() as tmp:
        plain = VllmServer(str(model), free_port(), Path(tmp) / "plain.log", args=ARGS, env=env)
        cached = VllmServer(str(model), free_port(), Path(tmp) / "kvtier.log", kvtier=kvtier, args=ARGS, env=env)
        try:
            for server in (plain, cached):
                server.launch()
            for server in (plain, cached):
                server.wait_ready()
            ttft(plain, payload)  # warm-up: first-request costs out of the timings
            ttft(cached, payload)  # and kvtier stores the prompt
            recompute, expected, _ = timed_repeats(plain, payload, args.repeats)
            loaded_s, answer, loaded = timed_repeats(cached, payload, args.repeats)
        finally:
            plain.stop()
            cached.stop()
    digest = digest_seconds(embeds)
    share = digest / loaded_s
    print(f"{args.positions}-position prompt embeddings: vLLM alone {recompute * 1e3:.0f} ms, kvtier "
          f"{loaded_s * 1e3:.0f} ms ({recompute / loaded_s:.2f}x), {loaded:.0f} tokens loaded per request; "
          f"digest {digest * 1e3:.2f} ms = {share:.2%} of kvtier's TTFT (limit {DIGEST_LIMIT:.0%})")
    result({"positions": args.positions, "ttft_vllm_alone_s": recompute, "ttft_kvtier_s": loaded_s,
            "speedup": recompute / loaded_s, "loaded_tokens_per_request": loaded, "digest_s": digest,
            "digest_share_of_ttft": share, "digest_limit": DIGEST_LIMIT, "digest_ok": share < DIGEST_LIMIT,
            "outputs_equal": answer == expected})


if __name__ == "__main__":
    main()
