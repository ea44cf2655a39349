"""Memory tier: store and retrieve bandwidth against a plain torch copy, and lookup latency of a long prompt.

A 512 MiB KV (4,096 tokens x 32 layers x 8 KV heads x 128, bf16 -- a Llama-3-8B-shaped cache) is stored into
and retrieved from a KVCache whose only tier is the memory tier, into reused buffers, and compared with
``dst.copy_(src)`` of the same bytes measured in the same run (the limit: one copy per hop is the design).
Three more limits are printed: a flat torch copy between the buffers the tier itself uses (the KV into the
tier's buffer, and the tier's buffer into the retrieve's output; on this machine the same copy ran at
0.91-1.22x of itself from one buffer to another in one process, where a buffer's pages land), and the
streaming-store copy the tier uses (kvtier/native/bulkcopy.py) as one flat copy between those same buffers, which
isolates what kvtier adds to its own copy. The tier's buffer sits on huge pages (tiers/slab.py), the other
tensors on the 4 KiB pages torch gives them; the time to start the tier (allocate and prefault its buffer) is
printed too, since huge pages move cost there.
Ratios use the best of interleaved repetitions on both sides (on a shared machine, interference only adds
time); medians are printed too. Lookup is timed for a 128k-token prompt fully cached (hashing 512 chunks plus
the index walk), for a numpy token array and for a Python list (median).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best, median, result, timed  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.native import bulkcopy  # noqa: E402

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
    started = time.perf_counter()
    cache = KVCache(SPEC, "bench/llama-8b-shape", config)  # allocates and prefaults the tier's buffer
    start_s = time.perf_counter() - started
    tokens = np.arange(args.tokens, dtype=np.uint32)
    kv = torch.randn(SPEC.chunk_shape(args.tokens)).to(SPEC.dtype)
    out = torch.empty_like(kv)
    copy_dst = torch.empty_like(kv)
    copy_dst.copy_(kv)  # fault pages in
    out.copy_(kv)
    keys = cache.keys(tokens)
    # The tier's own buffer, as one flat tensor over the bytes its entries occupy (a benchmark may look inside).
    tier_buffer = cache.tiers[0]._buffer[:n_bytes].view(SPEC.dtype).view(kv.shape)

    streaming = bulkcopy.available()
    copy_t, into_t, out_of_t, store_t, retrieve_t, s_into_t, s_out_of_t = [], [], [], [], [], [], []
    for _ in tqdm(range(args.reps), desc="store/retrieve 512 MiB", unit="rep"):
        copy_t += timed(lambda: copy_dst.copy_(kv), 1)
        into_t += timed(lambda: tier_buffer.copy_(kv), 1, setup=lambda: cache.tiers[0].delete(keys))
        out_of_t += timed(lambda: out.copy_(tier_buffer), 1)
        if streaming:
            s_into_t += timed(lambda: bulkcopy.copy_pairs([(tier_buffer, kv)]), 1,
                              setup=lambda: cache.tiers[0].delete(keys))
            s_out_of_t += timed(lambda: bulkcopy.copy_pairs([(out, tier_buffer)]), 1)
        store_t += timed(lambda: cache.store(tokens, kv), 1, setup=lambda: cache.tiers[0].delete(keys))
        retrieve_t += timed(lambda: cache.retrieve(tokens, out), 1)
    assert torch.equal(out, kv), "retrieved KV differs from what was stored"

    long_tokens = np.random.default_rng(0).integers(0, 128_000, 131_072, dtype=np.uint32)
    # Fill the index for all 512 chunks with one small chunk each (lookup cost does not depend on chunk bytes).
    small_spec_cache = KVCache(KVSpec(1, 1, 8, torch.bfloat16), "bench/index-only",
                               CacheConfig(chunk_size=args.chunk_size,
                                           tiers=[{"kind": "memory", "capacity_bytes": 64 << 20}]))
    small_spec_cache.store(long_tokens, torch.zeros(1, 2, len(long_tokens), 1, 8, dtype=torch.bfloat16))
    assert small_spec_cache.lookup(long_tokens) == len(long_tokens)
    as_list = long_tokens.tolist()
    lookup_array = timed(lambda: small_spec_cache.lookup(long_tokens), 30)
    lookup_list = timed(lambda: small_spec_cache.lookup(as_list), 15)

    copy_s, store_s, retrieve_s = best(copy_t), best(store_t), best(retrieve_t)
    into_s, out_of_s = best(into_t), best(out_of_t)
    s_into_s, s_out_of_s = (best(s_into_t), best(s_out_of_t)) if streaming else (float("nan"),) * 2
    gbps = n_bytes / 2**30
    print(f"KV size {n_bytes / 2**20:.0f} MiB, {len(keys)} chunks of {args.chunk_size} tokens, {args.reps} reps, "
          f"streaming copies {'on' if streaming else 'unavailable'}")
    print(f"{'operation':<40}{'best ms':>9}{'median ms':>11}{'GiB/s':>7}{'vs copy':>9}{'vs same-buffer copy':>21}"
          f"{'vs streaming':>14}")
    rows = (("torch copy (limit)", copy_t, copy_s, None), ("copy KV into the tier's buffer", into_t, into_s, s_into_s),
            ("copy the tier's buffer out", out_of_t, out_of_s, s_out_of_s),
            ("streaming copy into the tier's buffer", s_into_t, into_s, s_into_s),
            ("streaming copy out of the tier's buffer", s_out_of_t, out_of_s, s_out_of_s),
            ("store", store_t, into_s, s_into_s), ("retrieve", retrieve_t, out_of_s, s_out_of_s))
    for name, times, same, stream in rows:
        if not times:
            continue
        sec = best(times)
        print(f"{name:<40}{sec * 1e3:>9.1f}{median(times) * 1e3:>11.1f}{gbps / sec:>7.2f}{copy_s / sec:>9.2f}"
              f"{same / sec:>21.2f}" + (f"{stream / sec:>14.2f}" if stream is not None else ""))
    print(f"tier start (allocate and prefault {capacity / 2**20:.0f} MiB): {start_s * 1e3:.0f} ms")
    print(f"{'lookup 128k (numpy array)':<28}{median(lookup_array) * 1e3:>12.3f}")
    print(f"{'lookup 128k (Python list)':<28}{median(lookup_list) * 1e3:>12.3f}")
    result({
        "store_vs_copy": copy_s / store_s,
        "retrieve_vs_copy": copy_s / retrieve_s,
        "store_vs_same_buffer_copy": into_s / store_s,
        "retrieve_vs_same_buffer_copy": out_of_s / retrieve_s,
        "store_vs_streaming_copy": s_into_s / store_s if streaming else None,
        "retrieve_vs_streaming_copy": s_out_of_s / retrieve_s if streaming else None,
        "streaming_copies": streaming,
        "copy_gib_s": gbps / copy_s,
        "tier_start_ms": start_s * 1e3,
        "lookup_128k_ms": median(lookup_array) * 1e3,
        "lookup_128k_list_ms": median(lookup_list) * 1e3,
    })


if __name__ == "__main__":
    main()
