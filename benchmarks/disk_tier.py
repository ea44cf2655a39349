"""Disk tier benchmark: throughput against plain file I/O, re-index time, time to first token from disk.

1. **Throughput.** 1 GiB of sealed chunk blobs (8 MiB each: a 1B-class model's KV for 256 tokens in bf16)
   is written through the tier (put until accepted, then flush: every chunk fsynced, renamed, directory
   fsynced) and read back (get in batches of 16 chunks, one 4k-token prompt each), with O_DIRECT (the
   default) and buffered. The same bytes are written to one plain file (sequential 8 MiB writes, one fsync)
   and read back sequentially, on the same filesystem in the same run. The page cache is dropped before
   every read when this process may write /proc/sys/vm/drop_caches (root); otherwise the reads are warm and
   the output says so. Ratios compare the best round of each side (interference only adds time).
2. **Re-index.** 100,000 small chunks are written through the tier (fsync off to create them quickly), the
   tier is closed, and opening a new one on the directory is timed: a listing and a stat per file. Timed
   with the page cache dropped (cold) and warm, best of three each.
3. **Time to first token.** SmolLM2-135M-Instruct (``kvtier.integrations.models``; a random-weights Llama of the same
   shape if that package is missing) on a 2,048-token prompt: recompute (no cache) against the prompt's
   prefix only on disk (a new KVCache of memory + disk whose memory tier is empty, page cache dropped).
   Torch runs one intra-op thread for both sides (see ``main``); best of the rounds on each side.

Last line: ``RESULT {json}``. Run: ``python benchmarks/disk_tier.py [--dir DIR] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best, drop_caches, median, plain_read, plain_write, result  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.base.keys import Namespace  # noqa: E402
from kvtier.base.metrics import Metrics  # noqa: E402
from kvtier.codecs import BytesPayload, get_codec  # noqa: E402
from kvtier.codecs.blob import blob_bytes, encode_blob  # noqa: E402
from kvtier.tiers import DiskTier, DiskTierConfig, MemoryTierConfig, TierContext  # noqa: E402

SPEC = KVSpec(num_layers=16, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16)  # Llama-3.2-1B-like
CHUNK_TOKENS = 256
READ_BATCH = 16


def disk_tier(root: Path, capacity_bytes: int, **options) -> DiskTier:
    """A disk tier on ``root`` built as a KVCache builds it; ``options`` are DiskTierConfig's."""
    config = DiskTierConfig(path=root, capacity_bytes=capacity_bytes, **options)
    return DiskTier(config, TierContext(SPEC, Metrics(), "disk"))


def make_blobs(total_bytes: int) -> tuple[list[bytes], list[bytes]]:
    """Sealed blobs of random KV, as the cache would hand them to the tier, and their keys."""
    ns = Namespace("bench-model@1", SPEC, CHUNK_TOKENS)
    n = total_bytes // (SPEC.bytes_per_token * CHUNK_TOKENS)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, size=n * CHUNK_TOKENS, dtype=np.uint32)
    keys = ns.chunk_hashes(tokens)
    codec = get_codec("raw")
    blobs = []
    for i, key in enumerate(keys):
        raw = rng.integers(0, 1 << 16, size=SPEC.bytes_per_token * CHUNK_TOKENS // 2, dtype=np.uint16)
        chunk = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).view(SPEC.chunk_shape(CHUNK_TOKENS))
        blob = encode_blob(key, tokens[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS], codec, chunk, seal=True)
        blobs.append(bytes(blob_bytes(blob)))
    return keys, blobs


def tier_write(tier: DiskTier, keys, blobs) -> float:
    start = time.perf_counter()
    for key, blob in zip(keys, blobs):
        while not tier.put([(key, BytesPayload(blob))])[0]:  # queue full: the producer waits and retries
            time.sleep(0.0005)
    tier.flush()
    return time.perf_counter() - start


def tier_read(tier: DiskTier, keys, nbytes: int) -> float:
    start = time.perf_counter()
    got = 0
    for i in range(0, len(keys), READ_BATCH):
        with tier.get(keys[i : i + READ_BATCH]) as views:
            got += sum(v.nbytes for v in views if v is not None)
    elapsed = time.perf_counter() - start
    assert got == nbytes, f"read {got} of {nbytes} bytes"
    return elapsed


def throughput(base: Path, total: int, rounds: int) -> dict:
    """Per round: the same bytes written, then read, as a plain file, through the tier with O_DIRECT (its
    default) and through the tier buffered; the order alternates between rounds, and every write starts after
    an ``os.sync()`` with nothing deleted since (on a filesystem mounted with ``discard``, freeing blocks
    right before a write slows that write). Ratios compare the best round of each side (on a shared machine
    interference only adds time); the medians are printed too.
    """
    keys, blobs = make_blobs(total)
    nbytes = sum(len(b) for b in blobs)
    plain = str(base / "plain.bin")
    times: dict[str, list[float]] = {}
    cold = True
    modes = ("plain", "direct", "buffered")
    for r in range(rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        tiers = {m: disk_tier(base / f"tier-{m}", 2 * nbytes, o_direct=m == "direct") for m in modes[1:]}
        took = {}
        for mode in order:
            os.sync()
            took[f"w_{mode}"] = plain_write(plain, blobs) if mode == "plain" else tier_write(tiers[mode], keys, blobs)
        for mode in order:
            cold = drop_caches() and cold
            took[f"r_{mode}"] = (plain_read(plain, len(blobs[0])) if mode == "plain"
                                 else tier_read(tiers[mode], keys, nbytes))
        for mode, tier in tiers.items():
            tier.close()
            shutil.rmtree(base / f"tier-{mode}")
        os.unlink(plain)
        os.sync()
        for k, v in took.items():
            times.setdefault(k, []).append(v)
        print(f"round {r}: plain write {nbytes / took['w_plain'] / 2**20:.0f} MiB/s, read "
              f"{nbytes / took['r_plain'] / 2**20:.0f} MiB/s; tier O_DIRECT write "
              f"{took['w_plain'] / took['w_direct']:.2f}, read {took['r_plain'] / took['r_direct']:.2f} of plain; "
              f"buffered write {took['w_plain'] / took['w_buffered']:.2f}, read "
              f"{took['r_plain'] / took['r_buffered']:.2f}", flush=True)
    ratio = {f"{op}_{mode}": best(times[f"{op}_plain"]) / best(times[f"{op}_{mode}"])
             for op in ("w", "r") for mode in ("direct", "buffered")}
    medians = {k: median(times[f"{k[0]}_plain"]) / median(times[k]) for k in ratio}
    print("median ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    print(f"page cache dropped before every read: {cold}")
    return {"bytes": nbytes, "chunks": len(blobs),
            "write_vs_plain": ratio["w_direct"], "read_vs_plain": ratio["r_direct"],
            "write_buffered_vs_plain": ratio["w_buffered"], "read_buffered_vs_plain": ratio["r_buffered"],
            "plain_write_mibs": nbytes / best(times["w_plain"]) / 2**20,
            "plain_read_mibs": nbytes / best(times["r_plain"]) / 2**20, "page_cache_dropped": cold}


def reindex(base: Path, n: int) -> dict:
    root = base / "reindex"
    codec = get_codec("raw")
    chunk = torch.zeros((1, 2, 4, 1, 64), dtype=torch.bfloat16)  # 1 KiB payload per chunk
    tokens = np.arange(4, dtype=np.uint32)
    ns = Namespace("reindex-model@1", SPEC, 4)
    keys = ns.chunk_hashes(np.arange(4 * n, dtype=np.uint32))
    start = time.perf_counter()
    tier = disk_tier(root, 1 << 40, write_queue_depth=4096, o_direct=False, fsync=False)
    for key in keys:
        payload = encode_blob(key, tokens, codec, chunk, seal=True)
        while not tier.put([(key, payload)])[0]:
            time.sleep(0.001)
    tier.close()
    made = time.perf_counter() - start
    timings: dict[str, list[float]] = {"cold": [], "warm": []}
    dropped = True
    for _ in range(3):
        for label in ("cold", "warm"):
            if label == "cold":
                dropped = drop_caches() and dropped
            start = time.perf_counter()
            tier = disk_tier(root, 1 << 40)
            timings[label].append(time.perf_counter() - start)
            assert tier.stats().entries == n, tier.stats()
            tier.close()
    cold = best(timings["cold"]) if dropped else float("nan")
    print(f"re-index {n} chunks, best of 3: {cold:.2f} s cold, {best(timings['warm']):.2f} s warm "
          f"(medians {median(timings['cold']):.2f} / {median(timings['warm']):.2f} s; writing them took "
          f"{made:.1f} s)", flush=True)
    shutil.rmtree(root)
    return {"reindex_chunks": n, "reindex_100k_s": cold * 100_000 / n, "reindex_s_cold": cold,
            "reindex_s_warm": best(timings["warm"])}


def load_model():
    try:
        from kvtier.integrations.models import load_model as load

        model, _ = load()
        return model, "SmolLM2-135M-Instruct"
    except Exception as exc:  # noqa: BLE001 (any failure: fall back to random weights of the same shape)
        from transformers import LlamaConfig, LlamaForCausalLM

        print(f"(SmolLM2 unavailable: {exc}; using random weights)", flush=True)
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval(), "random Llama (SmolLM2-135M shape)"


def ttft(base: Path, prompt_tokens: int, rounds: int) -> dict:
    from kvtier.integrations.transformers import PrefixCachedLM, kv_spec, model_identity

    model, name = load_model()
    spec, ident = kv_spec(model), model_identity(model)
    prompt = np.random.default_rng(1).integers(100, 40000, size=prompt_tokens + 1).tolist()
    root = base / "ttft"
    disk = DiskTierConfig(path=root, capacity_bytes=8 << 30)
    memory = MemoryTierConfig(capacity_bytes=256 << 20)  # prefaulted at start, as a server would run it

    recompute = []
    for _ in range(rounds):
        recompute.append(PrefixCachedLM(model, None).generate(prompt, 1).ttft_s)
    with KVCache(spec, ident, CacheConfig(tiers=(disk,))) as cache:  # fill the disk, then close
        PrefixCachedLM(model, cache).generate(prompt, 1)
    from_disk = []
    for _ in range(rounds):
        cold = drop_caches()
        with KVCache(spec, ident, CacheConfig(tiers=(memory, disk))) as cache:  # memory empty: disk only
            stats = PrefixCachedLM(model, cache).generate(prompt, 1)
            assert stats.cached_tokens == prompt_tokens, stats.cached_tokens
            assert cache.metrics.get("kvtier_hit_tokens_total", tier="disk") == prompt_tokens
            from_disk.append((stats.ttft_s, stats.retrieve_s))
    shutil.rmtree(root)
    t_rec, t_disk = best(recompute), best([t for t, _ in from_disk])
    t_ret = best([r for _, r in from_disk])
    kv_mib = spec.bytes_per_token * prompt_tokens / 2**20
    print(f"TTFT {name}, {prompt_tokens}-token prefix ({kv_mib:.0f} MiB of KV), best of {rounds}: recompute "
          f"{t_rec:.3f} s, prefix from disk {t_disk:.3f} s (retrieve {t_ret:.3f} s), page cache dropped: {cold}",
          flush=True)
    return {"ttft_model": name, "ttft_prompt_tokens": prompt_tokens, "ttft_recompute_s": t_rec,
            "ttft_disk_s": t_disk, "ttft_disk_vs_recompute": t_disk / t_rec}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="a directory on the filesystem to measure (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="256 MiB, 20,000 chunks, 512 tokens: a smoke run")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    # One intra-op thread: on a small shared machine OpenMP threads oversubscribe the cores and a prefill
    # becomes several times slower (measured 3.5 s with one thread vs 12 s with two for 512 tokens here),
    # which would flatter the cached side. Recompute and the disk path use the same setting.
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir))
    try:
        figures = throughput(base, (256 if args.quick else 1024) << 20, args.rounds)
        figures |= reindex(base, 20_000 if args.quick else 100_000)
        figures |= ttft(base, 512 if args.quick else 2048, args.rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result(figures)


if __name__ == "__main__":
    main()
