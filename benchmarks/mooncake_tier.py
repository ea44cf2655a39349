"""Mooncake tier throughput against raw Mooncake Store batch calls on the same values in the same run, with the
Redis tier on the same machine alongside.

* store: ``KVCache.store`` of a 512 MiB prefix (16 chunks of 32 MiB: 32 layers, 8 KV heads, head_dim 128,
  bf16, chunk_size 256) into a KVCache whose only tier is Mooncake: the existence check, encoding, sealing
  (checksum), the copy into registered memory and ``batch_put_from``. Compared with raw ``batch_put_from`` of
  the same encoded blobs from a registered buffer (nothing else), under other keys.
* retrieve: ``KVCache.retrieve`` of that prefix into a reused output tensor: the existence check, the size
  lookup, ``batch_get_into``, checksum verification of every chunk and the copy into the output. Compared with
  raw ``batch_get_into`` of the same blobs into a registered buffer, sizes known in advance.
* Raw calls of one value each, one after another: KVCache's pipeline moves one window (here one chunk) per
  call, so raw calls of that shape are a peer too, and ratios against the faster raw shape are printed.
* The same retrieve through a tier allowed three transfers at once (``max_transfers: 3``; the default is one):
  KVCache reads a prefix in windows on a few threads, and this shows what running their transfers in
  parallel costs or gains here.
* The tier alone (``tier.put`` / ``tier.get``, no encoding, verification or copy-out) is reported too, and the
  same KVCache store/retrieve through a Redis tier (a redis-server on a unix socket, started here).

The pool's memory is a second process's (harness/mooncake_master.SegmentHost), and neither the tier nor the raw
client contributes any: every byte of both crosses the transfer engine over TCP, as between replicas. Ratios
are kvtier throughput / raw throughput (the target is >= 0.8) from the best of interleaved repetitions on both
sides (interference only adds time); medians are printed too. So is each call's CPU time in this process (median,
all threads: the Mooncake client's transfer threads run here), and its ratios (``*_cpu_vs_raw``: raw CPU /
kvtier CPU): where the cores are shared with other work, the CPU a transfer costs is what decides its speed, and
unlike wall-clock time it hardly depends on the load. A bar chart goes to results/mooncake_tier.png.
Fleet hit ratio, through ``kvtier sim`` (kvtier.apps.sim.pooling), in the same run: 4 replicas replay the Mooncake
synthetic trace (``$KVTIER_WORKLOADS`` or ``../shared/workloads/``) with 1,000 and 10,000 chunks of memory in
all, kept private (a quarter each), pooled (one shared tier every replica sees, as a Mooncake pool), or mixed
(each replica keeps 1/8 of its share private in front of a pool of the rest), all LRU, behind round-robin and
load-bounded affinity routing alike. Printed as chunk hit ratios and pooled / private, mixed / private, with
an infinite cache as the limit; a chart goes to results/mooncake_fleet.png. ``--fleet-only`` runs just this
part (no Mooncake master needed); ``--no-fleet`` skips it. Last line: ``RESULT {json}``.

    python benchmarks/mooncake_tier.py [--fleet-only] [--fleet-capacities 1000,10000] [--block-tokens 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _util import best, median, result, timed  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.base.keys import token_array  # noqa: E402
from kvtier.codecs import BytesPayload  # noqa: E402
from kvtier.codecs.blob import blob_bytes, encode_blob  # noqa: E402
from kvtier.tiers import MooncakeTierConfig, RedisTierConfig  # noqa: E402

MiB = 1 << 20
SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
#: A read that came back short: its transfer outlived the tier's deadline (a machine too loaded to measure on).
MISSED = "values missed their deadline (a transfer stalled); this run's figures would mean nothing"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-mib", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--fleet-only", action="store_true", help="only the fleet hit ratios (no Mooncake master)")
    ap.add_argument("--no-fleet", action="store_true", help="skip the fleet hit ratios")
    ap.add_argument("--fleet-capacities", default="1000,10000", help="chunks of memory of all 4 replicas")
    ap.add_argument("--private-share", type=float, default=0.125, help="mixed arm: share kept private")
    ap.add_argument("--block-tokens", type=int, default=16, help="token ids per trace block (= per chunk)")
    args = ap.parse_args()
    figures: dict = {}
    if not args.fleet_only:
        figures.update(run_throughput(args))
    if not args.no_fleet:
        figures["fleet_hit_ratio"] = run_fleet(args, Path(args.out) / "mooncake_fleet.png")
    result(figures)
    return 0


def run_throughput(args) -> dict:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from harness.mooncake_master import MooncakeMaster, SegmentHost

    prefix = Prefix(args.prefix_mib, args.chunk_size)
    pool_bytes = 2 * prefix.kv_bytes + 256 * MiB  # the tier's values and the raw ones, headers, slack
    with MooncakeMaster() as master, SegmentHost(master, pool_bytes):
        figures = run_mooncake(args, master, prefix)
    if not args.no_redis:
        figures.update(run_redis(args, prefix))
    plot(figures, Path(args.out) / "mooncake_tier.png")
    return figures


class Prefix:
    """The benchmark's prompt: tokens, canonical KV, and the encoded blob of each chunk."""

    def __init__(self, prefix_mib: int, chunk: int) -> None:
        self.chunk = chunk
        chunk_bytes = SPEC.bytes_per_token * chunk
        self.n_chunks = max(1, prefix_mib * MiB // chunk_bytes)
        self.n_tokens = self.n_chunks * chunk
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 100_000, (self.n_tokens,), generator=gen)
        self.kv = torch.randn(SPEC.chunk_shape(self.n_tokens), generator=gen).to(SPEC.dtype)
        self.kv_bytes = self.n_chunks * chunk_bytes
        self.total = 0  # bytes of the stored values, once blobs() made them
        print(f"prefix: {self.n_tokens} tokens, {self.n_chunks} chunks of {chunk_bytes / MiB:.0f} MiB")

    def blobs(self, cache: KVCache, tier) -> list[bytes]:
        """The exact sealed values ``tier`` stores for this prefix."""
        ids = token_array(self.tokens)
        c = self.chunk
        out = [bytes(blob_bytes(encode_blob(k, ids[i * c : (i + 1) * c], tier.codec, self.kv[:, :, i * c : (i + 1) * c],
                                            seal=tier.verifies)))
               for i, k in enumerate(cache.keys(self.tokens))]
        self.total = sum(len(b) for b in out)
        return out


def run_mooncake(args, master, prefix: Prefix) -> dict:
    from mooncake.store import MooncakeDistributedStore

    tier_cfg = MooncakeTierConfig(master_address=master.master_address, metadata_server=master.metadata_url,
                                  metrics_url=master.metrics_url, segment_bytes=0, timeout_s=5.0,
                                  buffer_bytes=prefix.kv_bytes + 64 * MiB)
    cache = KVCache(SPEC, "bench-model", CacheConfig(chunk_size=prefix.chunk, tiers=(tier_cfg,)))
    # the same pool and values, read with three transfers at once (the pipeline's windows in parallel)
    wide_cfg = dataclasses.replace(tier_cfg, max_transfers=3)
    wide = KVCache(SPEC, "bench-model", CacheConfig(chunk_size=prefix.chunk, tiers=(wide_cfg,)))
    tier = cache.tiers[0]
    keys = cache.keys(prefix.tokens)
    blobs = prefix.blobs(cache, tier)
    raw = MooncakeDistributedStore()
    if raw.setup("127.0.0.1", master.metadata_url, 0, 16 * MiB, "tcp", "", master.master_address) != 0:
        raise RuntimeError("raw client could not join the pool")
    src = np.frombuffer(b"".join(blobs), dtype=np.uint8).copy()
    dst = np.zeros_like(src)
    for arr in (src, dst):
        raw.register_buffer(arr.ctypes.data, arr.nbytes)
    sizes = [len(b) for b in blobs]
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    raw_keys = [f"bench:raw:{i}" for i in range(len(blobs))]
    out = SPEC.empty(prefix.n_tokens)
    payloads = [(k, BytesPayload(b)) for k, b in zip(keys, blobs)]

    def raw_put() -> None:
        assert raw.batch_put_from(raw_keys, [src.ctypes.data + o for o in offsets], sizes) == [0] * len(sizes)

    def raw_get() -> None:
        assert raw.batch_get_into(raw_keys, [dst.ctypes.data + o for o in offsets], sizes) == sizes

    def raw_put_each() -> None:
        for key, offset, size in zip(raw_keys, offsets, sizes):
            assert raw.batch_put_from([key], [src.ctypes.data + offset], [size]) == [0]

    def raw_get_each() -> None:
        for key, offset, size in zip(raw_keys, offsets, sizes):
            assert raw.batch_get_into([key], [dst.ctypes.data + offset], [size]) == [size]

    def kv_store() -> None:
        assert cache.store(prefix.tokens, prefix.kv) == prefix.n_tokens

    def kv_retrieve() -> None:
        assert cache.retrieve(prefix.tokens, out)[1] == prefix.n_tokens, MISSED

    def kv_retrieve_wide() -> None:
        assert wide.retrieve(prefix.tokens, out)[1] == prefix.n_tokens, MISSED

    def tier_put() -> None:
        assert tier.put(payloads) == [True] * len(payloads)

    def tier_get() -> None:
        with tier.get(keys) as got:
            assert all(v is not None for v in got), MISSED

    runs = [("raw batch_get_into", "raw_get", raw_get, None),
            ("raw, one value per call", "raw_get_each", raw_get_each, None),
            ("retrieve (KVCache)", "kv_retrieve", kv_retrieve, None),
            ("retrieve, 3 transfers", "kv_retrieve_wide", kv_retrieve_wide, None),
            ("get (tier alone)", "tier_get", tier_get, None),
            ("raw batch_put_from", "raw_put", raw_put, lambda: raw.batch_remove(raw_keys, True)),
            ("raw, one value per call", "raw_put_each", raw_put_each, lambda: raw.batch_remove(raw_keys, True)),
            ("store (KVCache)", "kv_store", kv_store, lambda: tier.delete(keys)),
            ("put (tier alone)", "tier_put", tier_put, lambda: tier.delete(keys))]
    try:
        raw_put()
        kv_store()
        raw_get()
        kv_retrieve()
        assert torch.equal(out, prefix.kv) and np.array_equal(src, dst)
        out.zero_()
        kv_retrieve_wide()
        assert torch.equal(out, prefix.kv)
        cpu: dict[str, list[float]] = {}
        times = interleaved(runs, args.reps, cpu)
    finally:
        raw.close()
        wide.close()
        cache.close()
    gbps = {k: prefix.total / best(v) / 1e9 for k, v in times.items()}
    report(runs, times, gbps, cpu)
    return {
        "retrieve_cpu_vs_raw": median(cpu["raw_get"]) / median(cpu["kv_retrieve"]),
        "store_cpu_vs_raw": median(cpu["raw_put"]) / median(cpu["kv_store"]),
        "tier_get_cpu_vs_raw": median(cpu["raw_get"]) / median(cpu["tier_get"]),
        "tier_put_cpu_vs_raw": median(cpu["raw_put"]) / median(cpu["tier_put"]),
        "retrieve_vs_raw": gbps["kv_retrieve"] / gbps["raw_get"],
        "store_vs_raw": gbps["kv_store"] / gbps["raw_put"],
        "retrieve_vs_raw_each": gbps["kv_retrieve"] / gbps["raw_get_each"],
        "store_vs_raw_each": gbps["kv_store"] / gbps["raw_put_each"],
        "retrieve_3_transfers_vs_raw": gbps["kv_retrieve_wide"] / gbps["raw_get"],
        "tier_get_vs_raw": gbps["tier_get"] / gbps["raw_get"],
        "tier_put_vs_raw": gbps["tier_put"] / gbps["raw_put"],
        "retrieve_vs_best_raw": gbps["kv_retrieve"] / max(gbps["raw_get"], gbps["raw_get_each"]),
        "store_vs_best_raw": gbps["kv_store"] / max(gbps["raw_put"], gbps["raw_put_each"]),
        "retrieve_gbps": gbps["kv_retrieve"], "raw_get_gbps": gbps["raw_get"],
        "store_gbps": gbps["kv_store"], "raw_put_gbps": gbps["raw_put"],
        "raw_get_each_gbps": gbps["raw_get_each"], "raw_put_each_gbps": gbps["raw_put_each"],
        "retrieve_median_vs_raw": median(times["raw_get"]) / median(times["kv_retrieve"]),
        "store_median_vs_raw": median(times["raw_put"]) / median(times["kv_store"]),
        "prefix_mib": prefix.total / MiB, "chunk_mib": sizes[0] / MiB, "reps": args.reps,
        "pool": "another process (TCP)",
    }


def run_redis(args, prefix: Prefix) -> dict:
    from harness.redis_server import RedisServer

    with RedisServer(maxmemory="3gb") as server:
        cfg = RedisTierConfig(url=server.url, timeout_s=5.0, buffer_pool_bytes=2 * prefix.total + 256 * MiB)
        cache = KVCache(SPEC, "bench-model", CacheConfig(chunk_size=prefix.chunk, tiers=(cfg,)))
        out = SPEC.empty(prefix.n_tokens)
        runs = [("store (KVCache, Redis)", "redis_store", lambda: cache.store(prefix.tokens, prefix.kv),
                 lambda: cache.tiers[0].delete(cache.keys(prefix.tokens))),
                ("retrieve (KVCache, Redis)", "redis_retrieve", lambda: cache.retrieve(prefix.tokens, out), None)]
        try:
            cache.store(prefix.tokens, prefix.kv)
            cache.retrieve(prefix.tokens, out)
            assert torch.equal(out, prefix.kv)
            times = interleaved(runs, args.reps)
        finally:
            cache.close()
    gbps = {k: prefix.total / best(v) / 1e9 for k, v in times.items()}
    report(runs, times, gbps)
    return {"redis_store_gbps": gbps["redis_store"], "redis_retrieve_gbps": gbps["redis_retrieve"]}


def run_fleet(args, png: Path) -> dict:
    """Pooled vs private vs mixed memory of 4 replicas on the Mooncake trace (kvtier.apps.sim.pooling)."""
    from tqdm import tqdm

    from kvtier.apps.sim.pooling import ARMS, compare
    from kvtier.apps.sim.reference import ideal_hits
    from kvtier.apps.sim.study import chunk_chains
    from kvtier.apps.sim.trace import read_mooncake
    from kvtier.fleet.scoring import Routing
    from kvtier.fleet.workloads import find_workload_file

    trace = find_workload_file("mooncake_synthetic_trace.jsonl")
    requests = read_mooncake(trace, block_tokens=args.block_tokens)
    chains = chunk_chains(requests, args.block_tokens)
    ideal = ideal_hits(chains) / sum(len(c) for c in chains)
    totals = [int(t) for t in args.fleet_capacities.split(",") if t.strip()]
    routings = [Routing.ROUND_ROBIN, Routing.LOAD_BOUNDED]
    with tqdm(total=len(requests) * len(totals) * len(routings) * len(ARMS), unit="req", desc="fleet",
              mininterval=1.0) as bar:
        points = compare(requests, args.block_tokens, totals=totals, routings=routings,
                         private_share=args.private_share, progress=lambda n: bar.update(n - bar.n))
    print(f"fleet: 4 replicas, {len(requests):,} requests of {trace.name}, chunk hit ratio (infinite cache "
          f"{ideal:.3f}); mixed keeps {args.private_share:g} of the memory private")
    print(f"{'chunks':>8} {'routing':<13}{'private':>9}{'pooled':>9}{'mixed':>9}{'pooled/priv':>13}{'mixed/priv':>12}")
    out: dict = {"replicas": 4, "requests": len(requests), "block_tokens": args.block_tokens,
                 "private_share": args.private_share, "policy": "lru", "ideal": round(ideal, 4)}
    for p in points:
        print(f"{p.total:>8,} {p.routing.value:<13}" + "".join(f"{p.hit[a]:>9.3f}" for a in ARMS)
              + f"{p.vs_private('pooled') or 0:>13.2f}{p.vs_private('mixed') or 0:>12.2f}")
        out.setdefault(str(p.total), {})[p.routing.value] = {
            **{a: round(p.hit[a], 4) for a in ARMS},
            "pooled_vs_private": round(p.vs_private("pooled") or 0.0, 3),
            "mixed_vs_private": round(p.vs_private("mixed") or 0.0, 3)}
    plot_fleet(points, ideal, png)
    return out


def plot_fleet(points, ideal: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtier.apps.sim.pooling import ARMS

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{p.total:,} chunks\n{p.routing.value}" for p in points]
    for i, arm in enumerate(ARMS):
        ax.bar([x + (i - 1) * 0.27 for x in range(len(points))], [p.hit[arm] for p in points], 0.27, label=arm)
    ax.axhline(ideal, color="#999", linestyle="--", label="infinite cache")
    ax.set_xticks(range(len(points)), labels)
    ax.set_ylabel("chunk hit ratio")
    ax.set_title("4 replicas, same memory in all: private vs pooled vs mixed (Mooncake trace, LRU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def interleaved(runs, reps: int, cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Every run once per round, rounds repeated (every other one in reverse order), so all of them see the
    same machine load and none always runs right after the same neighbour. With ``cpu``, each call's CPU
    seconds in this process (all its threads: the Mooncake client's transfer threads run here) go there too."""
    from tqdm import tqdm

    times: dict[str, list[float]] = {key: [] for _, key, _, _ in runs}
    for rep in tqdm(range(reps), desc="rounds", leave=False):
        for _label, key, fn, setup in (runs if rep % 2 == 0 else runs[::-1]):
            if cpu is not None:
                fn = _cpu_counted(fn, cpu.setdefault(key, []))
            times[key] += timed(fn, 1, setup=setup)
    return times


def _cpu_counted(fn, into: list[float]):
    def call() -> None:
        start = time.process_time()
        fn()
        into.append(time.process_time() - start)
    return call


def report(runs, times: dict[str, list[float]], gbps: dict[str, float],
           cpu: dict[str, list[float]] | None = None) -> None:
    cpu = cpu or {}
    print(f"{'operation':<28}{'best ms':>10}{'median ms':>11}{'GB/s':>8}{'CPU ms':>9}")
    for label, key, _, _ in runs:
        used = f"{median(cpu[key]) * 1e3:>9.1f}" if key in cpu else ""
        print(f"{label:<28}{best(times[key]) * 1e3:>10.1f}{median(times[key]) * 1e3:>11.1f}{gbps[key]:>8.2f}{used}")


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [("raw get", "raw_get_gbps"), ("raw get,\none per call", "raw_get_each_gbps"),
            ("KVCache retrieve\n(Mooncake)", "retrieve_gbps"),
            ("KVCache retrieve\n(Redis)", "redis_retrieve_gbps"), ("raw put", "raw_put_gbps"),
            ("raw put,\none per call", "raw_put_each_gbps"),
            ("KVCache store\n(Mooncake)", "store_gbps"), ("KVCache store\n(Redis)", "redis_store_gbps")]
    bars = [(label, figures[key]) for label, key in bars if key in figures]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(12, 4))
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["#999", "#bbb", "#2a7", "#c52"] * 2)
    ax.set_ylabel("GB/s (best of rounds)")
    ax.set_title(f"{figures['prefix_mib']:.0f} MiB prefix: Mooncake tier vs raw Mooncake calls, Redis tier")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
