"""Time to first token of a repeated long prompt on vLLM (CPU): recompute vs loading from kvtier.

A model of Qwen2.5-0.5B's shape (24 layers, 14 heads, 2 KV heads, head dim 64, random weights from a Qwen2
config) is built in a temporary directory. For each prompt length (default 2k, 4k and 8k tokens):

* **recompute** — plain vLLM (no connector): TTFT of a prompt its prefix cache does not hold, which is
  what a repeated prompt costs once vLLM's own prefix cache has been reset or has evicted it;
* **kvtier** — vLLM with KVTierConnector: the prompt runs once (kvtier stores it), vLLM's prefix cache is
  reset (``reset_prefix_cache()``), and the repeated prompt's TTFT is measured: its prefix comes from kvtier.
  The disk tier writes chunks on background threads and shows them once they are on disk, so its repeat
  comes 3 s later (a repeated prompt arriving within the same second would find only what has landed).

TTFT is the wall time of ``generate`` with ``max_tokens=1`` (prefill plus one token). Each engine runs in
its own process. The last line is ``RESULT {json}`` with each TTFT and the speed-ups
(recompute TTFT / kvtier TTFT) per tier and length.

    python benchmarks/vllm_ttft.py [--sizes 2048,4096,8192] [--tiers memory,disk]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK, CHUNK = 32, 256


def build_model(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>").save_pretrained(path)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1000000.0, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def tier_config(kind: str, workdir: Path) -> dict:
    tier: dict = {"kind": kind, "capacity_bytes": "2GiB"}
    if kind == "disk":  # room in the write queue for a whole 8k-token prompt (32 chunks) stored at once
        tier.update(path=str(workdir / "disk-tier"), write_queue_depth=64)
    return {"chunk_size": CHUNK, "tiers": [tier], "settle_s": 3.0 if kind == "disk" else 0.0}


def engine(spec: dict) -> dict:
    """Child process: one engine, the prompts of ``spec``; returns TTFTs (cold, and warm after a reset)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer, settle_s = None, 0.0
    if spec["kvtier"] is not None:
        extra = dict(spec["kvtier"])
        settle_s = extra.pop("settle_s")
        transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                    kv_role="kv_both", kv_connector_extra_config=extra)
    longest = max(len(p) for p in spec["prompts"])
    llm = LLM(model=spec["model"], dtype="bfloat16", block_size=BLOCK, max_model_len=longest + 64,
              max_num_batched_tokens=longest + 64, enable_prefix_caching=True, kv_transfer_config=transfer,
              enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def ttft(prompt: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return time.perf_counter() - start

    def reset() -> None:
        while not llm.reset_prefix_cache():  # finished requests' saves may still hold blocks for a moment
            time.sleep(0.05)

    out: dict = {"cold": [], "warm": []}
    for prompt in spec["prompts"]:
        out["cold"].append(ttft(prompt))
        print(f"  {len(prompt)} tokens: cold {out['cold'][-1]:.2f} s", file=sys.stderr, flush=True)
        if spec["kvtier"] is not None:
            reset()
            time.sleep(settle_s)  # the disk tier writes in the background; a chunk is visible once on disk
            out["warm"].append(ttft(prompt))
            print(f"  {len(prompt)} tokens: warm {out['warm'][-1]:.3f} s", file=sys.stderr, flush=True)
    return out


def run_engine(spec: dict, workdir: Path, name: str) -> dict:
    spec_path, out_path = workdir / f"{name}.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    subprocess.run([sys.executable, __file__, "--engine", str(spec_path), str(out_path)], env=env, check=True,
                   stdout=subprocess.DEVNULL if not os.environ.get("KVTIER_BENCH_VERBOSE") else None)
    return json.loads(out_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2048,4096,8192", help="prompt lengths in tokens")
    parser.add_argument("--tiers", default="memory,disk", help="kvtier tiers to measure, comma-separated")
    parser.add_argument("--engine", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        Path(args.engine[1]).write_text(json.dumps(engine(json.loads(Path(args.engine[0]).read_text()))))
        return
    import random

    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 151000) for _ in range(n)] for n in sizes]
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        workdir = Path(tmp)
        print("building a Qwen2.5-0.5B-shaped model with random weights", file=sys.stderr, flush=True)
        build_model(workdir / "model")
        base = {"model": str(workdir / "model"), "prompts": prompts}
        print("vLLM alone (recompute)", file=sys.stderr, flush=True)
        plain = run_engine({**base, "kvtier": None}, workdir, "plain")
        result: dict = {"sizes": sizes, "recompute_ttft_s": plain["cold"]}
        for kind in args.tiers.split(","):
            print(f"vLLM with kvtier ({kind} tier)", file=sys.stderr, flush=True)
            run = run_engine({**base, "kvtier": tier_config(kind, workdir)}, workdir, kind)
            result[f"{kind}_ttft_s"] = run["warm"]
            result[f"{kind}_store_run_ttft_s"] = run["cold"]
            for n, rec, hit in zip(sizes, plain["cold"], run["warm"]):
                result[f"speedup_{kind}_{n}"] = round(rec / hit, 2)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
