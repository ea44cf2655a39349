"""Time to first token of a hybrid SSM model with its prefix cached by kvtier vs recomputed, and the bytes
stored per cached token vs an attention-only model of similar size.

The hybrid has the shape of IBM Granite-4.0-H-350M (GraniteMoeHybrid: 32 layers, 28 Mamba2 with 48 heads of 32
and a 128-wide state, 4 attention layers with 12 heads and 4 KV heads of 64; 340 M parameters), random
weights, bfloat16 (its SSM states stay float32, as transformers and vLLM keep them). The attention-only peer
has SmolLM2-360M's shape (a Llama: 32 layers, 5 KV heads of 64; 362 M parameters).

For each document length (default 2k, 4k and 8k tokens), a prompt of the document plus a 64-token question
runs twice through one kvtier memory tier (default ``last`` snapshot policy):

* **recompute** -- the first run finds nothing cached and computes the whole prompt, exactly as generation
  without a cache does (the same segmented prefill; it also copies the state snapshot it will store);
* **kvtier** -- the second run restores the document's KV and the SSM state at its end from kvtier and
  computes only the question; its first token must equal the first run's.

Bytes per cached token: what the memory tier holds after the first run (KV chunks, the state snapshot and
blob headers) divided by the tokens it lets the second run skip. The peer's figure comes from a real
1,024-token prefill of its model stored by the same cache. One measurement per side: prefilling 8k tokens
through 28 Mamba2 layers on transformers' torch fallback takes minutes on two cores. A warm-up runs first.

    python benchmarks/hybrid_ttft.py [--lengths 2048,4096,8192] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import result  # noqa: E402

from kvtier import CacheConfig  # noqa: E402
from kvtier.integrations.hybrid import StatefulPrefixCachedLM  # noqa: E402
from kvtier.integrations.transformers import PrefixCachedLM  # noqa: E402

CHUNK, QUESTION = 256, 64
ATTENTION_LAYERS = (10, 13, 17, 27)


def granite_h_350m():
    from transformers import GraniteMoeHybridConfig

    layer_types = ["attention" if i in ATTENTION_LAYERS else "mamba" for i in range(32)]
    return GraniteMoeHybridConfig(
        vocab_size=100352, hidden_size=768, num_hidden_layers=32, layer_types=layer_types, num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=2048, shared_intermediate_size=2048, num_local_experts=0,
        num_experts_per_tok=0, mamba_n_heads=48, mamba_d_head=32, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, max_position_embeddings=32768,
        tie_word_embeddings=True)


def smollm2_360m():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                       num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=8192,
                       tie_word_embeddings=True)


def build(config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def cache_config() -> CacheConfig:
    return CacheConfig(chunk_size=CHUNK, tiers=[{"kind": "memory", "capacity_bytes": "1GiB", "prefault": False}])


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab - 10, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_length(model, n: int, vocab: int) -> dict[str, float]:
    prompt = tokens(n, n, vocab) + tokens(QUESTION, 1, vocab)
    lm = PrefixCachedLM.with_new_cache(model, cache_config())
    cold = lm.generate(prompt, 1)
    used = lm.cache.tiers[0].stats().used_bytes
    warm = lm.generate(prompt, 1)
    if warm.output_ids != cold.output_ids or cold.cached_tokens or warm.cached_tokens != n:
        raise SystemExit(f"{n}: the cached run gave {warm.output_ids} after {warm.cached_tokens} cached tokens, "
                         f"the full one {cold.output_ids}")
    snapshot = lm.cache.model_spec.snapshot_bytes
    lm.cache.close()
    return {"recompute_ttft_s": cold.ttft_s, "cached_ttft_s": warm.ttft_s, "speedup": cold.ttft_s / warm.ttft_s,
            "retrieve_s": warm.retrieve_s, "cached_tokens": warm.cached_tokens, "stored_bytes": used,
            "bytes_per_cached_token": used / n, "snapshot_bytes": snapshot}


def peer_bytes(dtype: torch.dtype) -> float:
    """Bytes per cached token of the attention-only peer, from a real 1,024-token prefill stored by kvtier."""
    model = build(smollm2_360m(), dtype)
    lm = PrefixCachedLM.with_new_cache(model, cache_config())
    lm.generate(tokens(4 * CHUNK + 1, 7, 49152), 1)
    tier = lm.cache.tiers[0]
    figure = tier.stats().used_bytes / lm.cache.metrics.get("kvtier_stored_tokens_total", tier=tier.name)
    lm.cache.close()
    return figure


def plot(lengths: list[int], runs: list[dict], peer: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(lengths))
    left.bar([i - 0.2 for i in x], [r["recompute_ttft_s"] for r in runs], 0.4, label="recompute")
    left.bar([i + 0.2 for i in x], [r["cached_ttft_s"] for r in runs], 0.4, label="kvtier (memory)")
    left.set(xticks=list(x), xticklabels=[f"{n // 1024}k" for n in lengths], ylabel="TTFT (s)",
             title="Granite-4.0-H-350M shape: time to first token")
    left.legend()
    right.bar(list(x), [r["bytes_per_cached_token"] / 1024 for r in runs], 0.5, label="hybrid: KV + SSM state")
    right.axhline(peer / 1024, color="C3", linestyle="--", label="attention-only (SmolLM2-360M shape)")
    right.set(xticks=list(x), xticklabels=[f"{n // 1024}k" for n in lengths], ylabel="KiB per cached token",
              title="stored bytes per cached token")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096,8192", help="document lengths in tokens")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    lengths = [int(n) for n in args.lengths.split(",")]
    config = granite_h_350m()
    model = build(config, dtype)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"hybrid: Granite-4.0-H-350M shape, {params:.0f} M parameters, {args.dtype}", file=sys.stderr)
    StatefulPrefixCachedLM(model, None, chunk_size=CHUNK).generate(tokens(CHUNK, 0, config.vocab_size), 1)  # warm-up
    runs = []
    for n in tqdm(lengths, desc="document lengths", file=sys.stderr):
        runs.append(one_length(model, n, config.vocab_size))
        r = runs[-1]
        tqdm.write(f"{n:>6} tokens: recompute {r['recompute_ttft_s']:.2f} s, kvtier {r['cached_ttft_s']:.3f} s "
                   f"({r['speedup']:.1f}x), {r['bytes_per_cached_token']:.0f} B per cached token", file=sys.stderr)
    del model
    peer = peer_bytes(dtype)
    out = Path("results/hybrid_ttft.png")
    plot(lengths, runs, peer, out)
    figures: dict = {"model": "Granite-4.0-H-350M shape (GraniteMoeHybrid), random weights", "params_m": round(params),
                     "dtype": args.dtype, "chunk_size": CHUNK, "peer": "SmolLM2-360M shape (Llama)",
                     "peer_bytes_per_cached_token": round(peer, 1), "plot": str(out)}
    for n, r in zip(lengths, runs):
        print(f"{n:>6} tokens: TTFT {r['cached_ttft_s']:.3f} s cached vs {r['recompute_ttft_s']:.2f} s recomputed "
              f"= {r['speedup']:.1f}x faster; {r['bytes_per_cached_token']:.0f} B per cached token = "
              f"{r['bytes_per_cached_token'] / peer:.2f}x the attention-only model's {peer:.0f} B")
        figures[str(n)] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
        figures[str(n)]["bytes_vs_attention_only"] = round(r["bytes_per_cached_token"] / peer, 3)
    result(figures)


if __name__ == "__main__":
    main()
