"""Memory tier: store and retrieve bandwidth against a plain torch copy, and lookup latency of a long prompt.

A 512 MiB KV (4,096 tokens x 32 layers x 8 KV heads x 128, bf16 -- a Llama-3-8B-shaped cache) is stored into
and retrieved from a KVCache whose only tier is the memory tier, into reused buffers, and compared with
``dst.copy_(src)`` of the same bytes measured in the same run (the limit: one copy per hop is the design).
Ratios use the best of interleaved repetitions on both sides (on a shared machine, interference only adds
time); medians are printed too. Lookup is timed for a 128k-token prompt fully cached (hashing 512 chunks plus the index walk), for a numpy
token array and for a Python list (median).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best, median, result, timed  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402

SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--chunk-size", type=int, default=256)
    args = parser.parse_args()

    n_bytes = SPEC.bytes_per_token * args.tokens
    capacity = n_bytes + (n_bytes // 8)
    config = CacheConfig(chunk_size=args.chunk_size, tiers=[{"kind": "memory", "capacity_bytes": capacity}])
    cache = KVCache(SPEC, "bench/llama-8b-shape", config)
    tokens = np.arange(args.tokens, dtype=np.uint32)
    kv = torch.randn(SPEC.chunk_shape(args.tokens)).to(SPEC.dtype)
    out = torch.empty_like(kv)
    copy_dst = torch.empty_like(kv)
    copy_dst.copy_(kv)  # fault pages in
    out.copy_(kv)
    keys = cache.keys(tokens)

    copy_t, store_t, retrieve_t = [], [], []
    for _ in tqdm(range(args.reps), desc="store/retrieve 512 MiB", unit="rep"):
        copy_t += timed(lambda: copy_dst.copy_(kv), 1)
        store_t += timed(lambda: cache.store(tokens, kv), 1, setup=lambda: cache.tiers[0].delete(keys))
        retrieve_t += timed(lambda: cache.retrieve(tokens, out), 1)
    assert torch.equal(out, kv), "retrieved KV differs from what was stored"

    long_tokens = np.random.default_rng(0).integers(0, 128_000, 131_072, dtype=np.uint32)
    # Fill the index for all 512 chunks with one small chunk each (lookup cost does not depend on chunk bytes).
    small_spec_cache = KVCache(KVSpec(1, 1, 8, torch.bfloat16), "bench/index-only",
                               CacheConfig(chunk_size=args.chunk_size, tiers=[{"kind": "memory", "capacity_bytes": 64 << 20}]))
    small_spec_cache.store(long_tokens, torch.zeros(1, 2, len(long_tokens), 1, 8, dtype=torch.bfloat16))
    assert small_spec_cache.lookup(long_tokens) == len(long_tokens)
    as_list = long_tokens.tolist()
    lookup_array = timed(lambda: small_spec_cache.lookup(long_tokens), 30)
    lookup_list = timed(lambda: small_spec_cache.lookup(as_list), 15)

    copy_s, store_s, retrieve_s = best(copy_t), best(store_t), best(retrieve_t)
    gbps = n_bytes / 2**30
    print(f"KV size {n_bytes / 2**20:.0f} MiB, {len(keys)} chunks of {args.chunk_size} tokens, {args.reps} reps")
    print(f"{'operation':<28}{'best ms':>10}{'median ms':>11}{'GiB/s':>8}{'vs copy':>9}")
    for name, times in (("torch copy (limit)", copy_t), ("store", store_t), ("retrieve", retrieve_t)):
        sec = best(times)
        print(f"{name:<28}{sec * 1e3:>10.1f}{median(times) * 1e3:>11.1f}{gbps / sec:>8.2f}{copy_s / sec:>9.2f}")
    print(f"{'lookup 128k (numpy array)':<28}{median(lookup_array) * 1e3:>12.3f}")
    print(f"{'lookup 128k (Python list)':<28}{median(lookup_list) * 1e3:>12.3f}")
    result({
        "store_vs_copy": copy_s / store_s,
        "retrieve_vs_copy": copy_s / retrieve_s,
        "copy_gib_s": gbps / copy_s,
        "lookup_128k_ms": median(lookup_array) * 1e3,
        "lookup_128k_list_ms": median(lookup_list) * 1e3,
    })


if __name__ == "__main__":
    main()
