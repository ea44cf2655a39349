"""Does compression pay for itself? Time to load a prefix per codec, against raw from the same tier.

1. **Loads.** A ``--gib`` (default 1 GiB) prefix of real KV -- SmolLM2-135M-Instruct's bf16 KV over LooGLE
   documents, 256-token chunks, tiled to the size with fresh token ids per chunk -- is stored through a
   KVCache whose only tier is the disk tier (O_DIRECT, page cache dropped before every read) or a Redis
   tier on a ``redis-server`` this script starts (unix socket), once per codec. Then the prefix is
   retrieved into a reused tensor: read, verify, decode and copy out, the path a request takes. Codecs are
   interleaved within each repetition; the best of ``--reps`` per (tier, codec) is kept, and each codec's
   figure is raw's time over its own (>1: it loads faster than raw).
2. **Codec speed.** Each codec's encode and decode GB/s (of KV) on one thread and on every core (a thread
   pool; the codecs release the GIL), decoding into reused tensors as a retrieve does, against a plain copy
   of the same bytes into reused tensors (``kvtier.apps.calibrate.measure``).

Run as root for the cold disk reads (else they are warm and the output says so). Prints tables with the
load average next to them, writes ``--plot`` (PNG), and ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _util import best, drop_caches, result, timed  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.apps.calibrate.measure import measure_codec, plain_copy_seconds, synthetic_kv  # noqa: E402
from kvtier.base.errors import ConfigError  # noqa: E402
from kvtier.tiers import Flushable  # noqa: E402

CODECS = ["raw", "lossless", "int8", "int4", "cachegen"]
CHUNK = 256
_ROOT = Path(__file__).resolve().parents[1]
DOCS = next((p for p in (Path(os.environ.get("KVTIER_WORKLOADS", "/nonexistent")),
                         _ROOT.parent / "shared" / "workloads",
                         _ROOT.parent.parent / "shared" / "workloads") if p.is_dir()), None)


def real_chunks(n_docs: int, tokens: int) -> tuple[list[torch.Tensor], KVSpec, str]:
    """256-token chunks of SmolLM2's bf16 KV over the first ``tokens`` tokens of ``n_docs`` documents."""
    try:
        from kvtier.integrations.models import load_model
        from kvtier.integrations.transformers import to_canonical

        model, tok = load_model()
    except (ImportError, OSError, ConfigError) as exc:  # no transformers / model package: synthetic KV
        print(f"SmolLM2 unavailable ({exc}); using synthetic KV of the same shape")
        spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
        kv = synthetic_kv(spec, n_docs * tokens)
        return [kv[:, :, i : i + CHUNK].contiguous() for i in range(0, kv.shape[2], CHUNK)], spec, "synthetic"
    cfg = model.config
    spec = KVSpec(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                  head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=torch.bfloat16)
    chunks = []
    with (DOCS / "loogle_longdep_qa.jsonl").open() as fh:
        docs = [json.loads(line)["input"] for line, _ in zip(fh, range(n_docs))]
    for doc in tqdm(docs, desc="real KV", leave=False):
        ids = tok(doc).input_ids[:tokens]
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        kv = to_canonical(out.past_key_values).to(torch.bfloat16)
        chunks += [kv[:, :, i : i + CHUNK].contiguous() for i in range(0, len(ids) // CHUNK * CHUNK, CHUNK)]
    return chunks, spec, "SmolLM2-135M-Instruct KV over LooGLE"


class TiledSource:
    """The real chunks repeated to any length (each chunk is encoded on its own, so tiling changes nothing)."""

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        self.chunks = chunks

    def chunk(self, start: int, end: int) -> torch.Tensor:
        return self.chunks[start // CHUNK % len(self.chunks)]


def tier_configs(kind: str, codec: str, where: str) -> tuple:
    if kind == "disk":
        return ({"kind": "disk", "path": f"{where}/{codec}", "codec": codec, "capacity_bytes": "64GiB",
                 "fsync": False},)
    return ({"kind": "redis", "url": where, "codec": codec, "key_prefix": f"bench:{codec}:", "timeout_s": 30.0},)


def measure_tier(kind: str, where: str, spec: KVSpec, source: TiledSource, n_chunks: int, codecs, reps: int,
                 cold: bool) -> dict[str, float]:
    """Best retrieve seconds per codec for the prefix, codecs interleaved within each repetition."""
    tokens = np.random.default_rng(1).integers(0, 100_000, n_chunks * CHUNK, dtype=np.uint32)
    caches = {c: KVCache(spec, "bench/codec-loads", CacheConfig(chunk_size=CHUNK, tiers=tier_configs(kind, c, where)))
              for c in codecs}
    out = spec.empty(n_chunks * CHUNK)
    out.zero_()  # fault the destination in once, outside the timings
    times: dict[str, list[float]] = {c: [] for c in codecs}
    try:
        for codec, cache in caches.items():
            built = cache.tiers[0].codec.name
            assert built == codec, f"{kind} tier built with {built}, not {codec}"
        for codec, cache in tqdm(caches.items(), desc=f"store into {kind}", leave=False):
            while cache.lookup(tokens) < len(tokens):  # a disk tier turns stores away while its queue is full
                cache.store(tokens, source)
                if isinstance(cache.tiers[0], Flushable):
                    cache.tiers[0].flush()
        for _ in tqdm(range(reps), desc=f"retrieve from {kind}", leave=False):
            for codec, cache in caches.items():
                def load(cache=cache) -> None:
                    _, n = cache.retrieve(tokens, out)
                    assert n == len(tokens), f"{kind}/{codec} loaded {n} of {len(tokens)} tokens"

                times[codec] += timed(load, 1, setup=drop_caches if cold else None)
    finally:
        for cache in caches.values():
            cache.close()
    return {c: best(t) for c, t in times.items()}


def plot(loads: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    tiers = list(loads)
    codecs = list(next(iter(loads.values())))
    width = 0.8 / len(tiers)
    for k, tier in enumerate(tiers):
        xs = [i + k * width for i in range(len(codecs))]
        ax.bar(xs, [loads[tier][c]["vs_raw"] for c in codecs], width, label=tier)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + width * (len(tiers) - 1) / 2 for i in range(len(codecs))], codecs)
    ax.set_ylabel("load speed vs raw from the same tier")
    ax.set_title("Loading a prefix: compressed vs raw")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="prefix size in GiB of bf16 KV")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--codecs", nargs="+", default=CODECS)
    ap.add_argument("--docs", type=int, default=2, help="LooGLE documents the real KV comes from")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--dir", default=None, help="where the disk tier writes (default: a temporary directory)")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--plot", default="results/codec_loads.png")
    args = ap.parse_args()
    chunks, spec, origin = real_chunks(args.docs, args.doc_tokens)
    chunk_bytes = chunks[0].numel() * 2
    n_chunks = max(1, int(args.gib * 2**30) // chunk_bytes)
    nbytes = n_chunks * chunk_bytes
    print(f"KV: {origin}, {len(chunks)} distinct chunks of {chunk_bytes / 2**20:.1f} MiB; prefix {n_chunks} chunks, "
          f"{nbytes / 2**30:.2f} GiB")

    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        speeds = {c: measure_codec(c, chunks[:16], 3, pool) for c in tqdm(args.codecs, desc="codec speed", leave=False)}
    memcpy = sum(c.numel() * 2 for c in chunks[:16]) / plain_copy_seconds(chunks[:16], 5) / 1e9
    print(f"\ncodec speed, GB/s of KV (load average {load0:.1f} -> {os.getloadavg()[0]:.1f}); plain copy {memcpy:.2f}")
    print(f"{'codec':<10}{'ratio':>7}{'encode':>8}{'decode':>8}{'decode all cores':>18}{'decode/memcpy':>15}")
    for c, s in speeds.items():
        print(f"{c:<10}{s.ratio:>7.2f}{s.encode_gbs:>8.2f}{s.decode_gbs:>8.2f}{s.decode_all_cores_gbs:>18.2f}"
              f"{s.decode_gbs / memcpy:>15.2f}")

    cold = drop_caches()
    source = TiledSource(chunks)
    where = {}
    tmp = tempfile.mkdtemp(prefix="kvtier-codec-loads-", dir=args.dir)
    where["disk"] = tmp
    server = None
    if not args.no_redis:
        from harness.redis_server import RedisServer

        server = RedisServer(maxmemory=f"{int(args.gib * len(args.codecs) + 2)}gb").start()
        where["redis"] = server.url
    loads: dict[str, dict] = {}
    try:
        for kind, place in where.items():
            before = os.getloadavg()[0]
            secs = measure_tier(kind, place, spec, source, n_chunks, args.codecs, args.reps, cold and kind == "disk")
            raw = secs.get("raw", min(secs.values()))
            loads[kind] = {c: {"seconds": s, "gb_s": nbytes / s / 1e9, "vs_raw": raw / s} for c, s in secs.items()}
            loads[kind]["_load_average"] = (before, os.getloadavg()[0])
            if kind == "redis":
                server.flush()
            else:
                shutil.rmtree(place, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if server is not None:
            server.stop()
    for kind, rows in loads.items():
        la = rows.pop("_load_average")
        note = " (page cache dropped before every read)" if kind == "disk" and cold else (
            " (WARM: not root, page cache not dropped)" if kind == "disk" else "")
        print(f"\nload {nbytes / 2**30:.2f} GiB from {kind}{note}, load average {la[0]:.1f} -> {la[1]:.1f}")
        print(f"{'codec':<10}{'seconds':>9}{'GB/s of KV':>12}{'vs raw':>8}")
        for c, r in rows.items():
            print(f"{c:<10}{r['seconds']:>9.3f}{r['gb_s']:>12.2f}{r['vs_raw']:>8.2f}")
    plot(loads, args.plot)
    print(f"\nplot: {args.plot}")
    figures = {"kv": origin, "prefix_gib": round(nbytes / 2**30, 3), "cold_disk": cold, "memcpy_gb_s": memcpy,
               "load_average": os.getloadavg()[0]}
    for c, s in speeds.items():
        figures[f"{c}_ratio"] = s.ratio
        figures[f"{c}_encode_gb_s"] = s.encode_gbs
        figures[f"{c}_decode_gb_s"] = s.decode_gbs
        figures[f"{c}_decode_all_cores_gb_s"] = s.decode_all_cores_gbs
    for kind, rows in loads.items():
        for c, r in rows.items():
            figures[f"{kind}_{c}_vs_raw"] = r["vs_raw"]
            figures[f"{kind}_{c}_gb_s"] = r["gb_s"]
    result(figures)


if __name__ == "__main__":
    main()
