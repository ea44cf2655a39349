"""GPU KV blocks <-> the memory tier, against the PCIe limit measured in the same run (needs a CUDA GPU).

A prefix of ``--prefix-mib`` of Llama-3-8B-shaped KV (32 layers x 8 KV heads x 128, bf16: 128 KiB a token) sits
in vLLM 0.32's paged blocks on the GPU (16 tokens a block, FlashAttention's ``LBNHC`` layout and the cross-layer
``BLNHC``, built as vLLM builds them: ``kvtier.integrations.vllm.layouts``), in blocks scattered at random over
a cache twice its size. It is stored into a ``KVCache`` whose only tier is the memory tier (its buffer pinned in
place) through the connector's ``PagedSource`` and loaded back into other random blocks through ``PagedSink``,
per chunk size. The limit is one ``copy_`` of the same bytes between pinned host memory and the GPU
(``cudaMemcpyAsync``), each way, timed with CUDA events in the same run.

Also measured: the gather and scatter kernels alone (GPU memory to GPU memory); the checksum a verifying tier
computes (XXH3-128 on the host) and a store and load through such a tier (the disk tier on /dev/shm); a bf16
matrix product stream alone and while 1 GiB prefixes load and store beside it; and the memory tier with its
buffer on the GPU (``device: cuda:0``). Ratios use the best of ``--reps`` repetitions on both sides; medians are
printed too. A table, a PNG (``--plot``) and one ``RESULT {json}`` line close the run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import xxhash
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best, median, result  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.integrations.vllm.layouts import vllm_layers  # noqa: E402
from kvtier.integrations.vllm.paged import PagedKV, PagedSink, PagedSource  # noqa: E402

SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
BLOCK = 16
GiB = 1 << 30


def event_seconds(fn, reps: int) -> list[float]:
    """Seconds of GPU time per call of ``fn`` (CUDA events on the current stream), after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def wall_seconds(fn, reps: int, between=None) -> list[float]:
    """Wall seconds per call of ``fn`` (which returns once its work has landed), ``between`` untimed."""
    times = []
    for _ in range(reps + 1):
        if between is not None:
            between()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times[1:]


def limits(nbytes: int, reps: int) -> dict[str, list[float]]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = {"h2d": event_seconds(lambda: dev.copy_(host, non_blocking=True), reps),
               "d2h": event_seconds(lambda: host.copy_(dev, non_blocking=True), reps)}
    return out


class Prefix:
    """One prefix in random blocks of a paged cache, and other random blocks to load it into."""

    def __init__(self, layout: str, tokens: int, seed: int = 0) -> None:
        n_blocks = tokens // BLOCK
        # a cache four times the prefix: at 1 GiB, over 2^31 elements, as any real one is (64-bit indexing)
        self.layers = vllm_layers(layout, SPEC.num_layers, 4 * n_blocks, SPEC.num_kv_heads, BLOCK, SPEC.head_dim,
                                  SPEC.dtype, device="cuda")
        self.paged = PagedKV(self.layers, BLOCK, rows_split=False)
        order = torch.randperm(4 * n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.saved, self.loaded = order[:n_blocks], order[n_blocks : 2 * n_blocks]
        self.tokens = np.arange(tokens, dtype=np.uint32)

    def check(self) -> bool:
        torch.cuda.synchronize()
        a = self.paged.gather(self.saved, 0, len(self.tokens))
        b = self.paged.gather(self.loaded, 0, len(self.tokens))
        torch.cuda.synchronize()
        return bool(torch.equal(a, b))


def memory_cache(chunk: int, nbytes: int, **tier) -> KVCache:
    capacity = nbytes + nbytes // 8
    return KVCache(SPEC, "bench/llama-8b-shape", CacheConfig(chunk_size=chunk, tiers=[
        {"kind": "memory", "capacity_bytes": capacity, **tier}]))


def store_and_load(cache: KVCache, prefix: Prefix, reps: int) -> tuple[list[float], list[float], bool]:
    keys = cache.keys(prefix.tokens)

    def forget() -> None:
        for tier in cache.tiers:
            tier.delete(keys)

    def store() -> None:
        cache.store(prefix.tokens, PagedSource(prefix.paged, prefix.saved))
        for tier in cache.tiers:
            getattr(tier, "flush", lambda: None)()

    def load() -> None:
        _, n = cache.retrieve(prefix.tokens, PagedSink(prefix.paged, prefix.loaded, 0))
        prefix.paged.synchronize()
        assert n == len(prefix.tokens), n

    stores = wall_seconds(store, reps, between=forget)
    loads = wall_seconds(load, reps)
    return stores, loads, prefix.check()


def kernels(prefix: Prefix, chunk: int, reps: int) -> dict[str, list[float]]:
    """The gather and the scatter of one chunk over random blocks, GPU memory only."""
    paged = prefix.paged
    ids = paged._gpu.to_device(paged.kernel_blocks(prefix.saved, 0, chunk))
    torch.cuda.synchronize()
    out = paged._gather(ids, chunk)
    return {"gather": event_seconds(lambda: paged._gather(ids, chunk), reps),
            "scatter": event_seconds(lambda: paged._scatter(ids, out), reps)}


def checksum_seconds(nbytes: int, reps: int) -> list[float]:
    data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_(0, 255).numpy()
    return wall_seconds(lambda: xxhash.xxh3_128(memoryview(data)).digest(), reps)


def overlap(prefix: Prefix, cache: KVCache, reps: int) -> dict[str, float]:
    """A stream of bf16 matrix products alone, then while the prefix loads and stores over and over beside it."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # one launch: the Python thread moving KV cannot starve the stream of work
    with torch.cuda.graph(graph):
        for _ in range(60):
            torch.mm(a, b, out=c)
    stream = torch.cuda.Stream()

    def products() -> float:
        with torch.cuda.stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    products()
    alone = [products() for _ in range(reps)]
    keys = cache.keys(prefix.tokens)
    stop, moved = threading.Event(), [0, 0]

    def traffic() -> None:
        while not stop.is_set():
            _, got = cache.retrieve(prefix.tokens, PagedSink(prefix.paged, prefix.loaded, 0))
            prefix.paged.synchronize()
            moved[0] += got
            cache.tiers[0].delete(keys)
            moved[1] += cache.store(prefix.tokens, PagedSource(prefix.paged, prefix.saved))

    worker = threading.Thread(target=traffic)
    worker.start()
    time.sleep(0.2)
    try:
        busy = [products() for _ in range(reps)]
    finally:
        stop.set()
        worker.join()
    return {"alone_s": best(alone), "busy_s": best(busy), "busy_median_s": median(busy),
            "alone_median_s": median(alone), "gib_loaded": moved[0] * SPEC.bytes_per_token / GiB,
            "gib_stored": moved[1] * SPEC.bytes_per_token / GiB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-mib", type=int, default=1024)
    parser.add_argument("--chunks", default="64,128,256,512,1024")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--plot", default="results/cuda_transfer.png")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_transfer: needs a CUDA GPU")
    tokens = args.prefix_mib * (1 << 20) // SPEC.bytes_per_token
    nbytes = tokens * SPEC.bytes_per_token
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.total_memory / GiB:.0f} GiB, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; prefix {tokens} tokens = {nbytes / GiB:.2f} GiB")
    limit = limits(nbytes, args.reps)
    h2d, d2h = best(limit["h2d"]), best(limit["d2h"])
    print(f"limit (pinned cudaMemcpyAsync, {nbytes >> 20} MiB): host->GPU {nbytes / h2d / 1e9:.1f} GB/s, "
          f"GPU->host {nbytes / d2h / 1e9:.1f} GB/s")
    rows, figures = [], {"device": props.name, "h2d_gbps": nbytes / h2d / 1e9, "d2h_gbps": nbytes / d2h / 1e9}
    print("(gather/scatter: bytes read + written per second, GPU memory to GPU memory, one chunk over random blocks)")
    print(f"{'layout':7} {'chunk':>5} {'store/lim':>9} {'load/lim':>8} {'store GB/s':>10} {'load GB/s':>9} "
          f"{'store med s':>11} {'load med s':>10} {'same':>5} {'gather GB/s':>11} {'scatter GB/s':>12}")
    for layout in ("LBNHC", "BLNHC"):
        prefix = Prefix(layout, tokens)
        with memory_cache(256, nbytes) as cache:  # untimed: CUDA's and the allocators' first use
            store_and_load(cache, prefix, 1)
        for chunk in tqdm([int(c) for c in args.chunks.split(",")], desc=f"{layout} chunk sizes", leave=False):
            try:
                with memory_cache(chunk, nbytes) as cache:
                    stores, loads, same = store_and_load(cache, prefix, args.reps)
                k = kernels(prefix, chunk, args.reps)
            except Exception as exc:  # report it and go on: the other sizes still say something
                print(f"{layout} chunk {chunk} failed: {exc!r}")
                figures[f"{layout}_{chunk}_failed"] = repr(exc)
                continue
            chunk_bytes = chunk * SPEC.bytes_per_token
            r = (layout, chunk, d2h / best(stores), h2d / best(loads), nbytes / best(stores) / 1e9,
                 nbytes / best(loads) / 1e9, median(stores), median(loads), same,
                 2 * chunk_bytes / best(k["gather"]) / 1e9, 2 * chunk_bytes / best(k["scatter"]) / 1e9)
            rows.append(r)
            tqdm.write(f"{r[0]:7} {r[1]:5d} {r[2]:9.2f} {r[3]:8.2f} {r[4]:10.1f} {r[5]:9.1f} {r[6]:11.4f} "
                       f"{r[7]:10.4f} {str(r[8]):>5} {r[9]:11.0f} {r[10]:12.0f}")
            figures[f"{layout}_store_{chunk}_vs_limit"] = d2h / best(stores)
            figures[f"{layout}_load_{chunk}_vs_limit"] = h2d / best(loads)
            figures[f"{layout}_identical_{chunk}"] = same
        del prefix

    for section in (verified, beside_matmuls, gpu_tier):
        try:
            section(tokens, nbytes, h2d, d2h, args.reps, figures)
        except Exception as exc:  # one section failing must not cost the others their figures
            print(f"{section.__name__} failed: {exc!r}")
            figures[f"{section.__name__}_failed"] = repr(exc)
    plot(rows, args.plot, props.name)
    result(figures)


def verified(tokens: int, nbytes: int, h2d: float, d2h: float, reps: int, figures: dict) -> None:
    """The checksum a verifying tier computes, and a store and load through one (the disk tier, page cache)."""
    digest = checksum_seconds(256 << 20, reps)
    figures["xxh3_gbps_one_thread"] = (256 << 20) / best(digest) / 1e9
    prefix = Prefix("LBNHC", tokens)
    with tempfile.TemporaryDirectory() as tmp:
        disk = KVCache(SPEC, "bench/llama-8b-shape", CacheConfig(chunk_size=256, tiers=[
            {"kind": "disk", "path": tmp, "capacity_bytes": 2 * nbytes, "o_direct": False, "fsync": False}]))
        with disk:
            stores, loads, same = store_and_load(disk, prefix, max(3, reps // 2))
    figures.update(verified_store_vs_limit=d2h / best(stores), verified_load_vs_limit=h2d / best(loads),
                   verified_identical=same)
    print(f"\nchecksum (XXH3-128, one host thread): {figures['xxh3_gbps_one_thread']:.1f} GB/s; through a verifying "
          f"tier (disk, page cache, chunk 256): store {d2h / best(stores):.2f} of the limit, load "
          f"{h2d / best(loads):.2f}, identical {same}")


def beside_matmuls(tokens: int, nbytes: int, h2d: float, d2h: float, reps: int, figures: dict) -> None:
    """A matrix-product stream's time alone and beside loads and stores of the prefix (``overlap``)."""
    prefix = Prefix("LBNHC", tokens)
    with memory_cache(256, nbytes) as cache:
        cache.store(prefix.tokens, PagedSource(prefix.paged, prefix.saved))
        o = overlap(prefix, cache, reps)
    figures["matmul_slowdown"] = o["busy_s"] / o["alone_s"]
    figures["matmul_slowdown_median"] = o["busy_median_s"] / o["alone_median_s"]
    print(f"matmul stream (60 bf16 8192^3 products): alone {o['alone_s'] * 1e3:.1f} ms, beside loads and stores "
          f"{o['busy_s'] * 1e3:.1f} ms ({figures['matmul_slowdown']:.3f}x best, "
          f"{figures['matmul_slowdown_median']:.3f}x median); {o['gib_loaded']:.1f} GiB loaded, "
          f"{o['gib_stored']:.1f} GiB stored meanwhile")


def gpu_tier(tokens: int, nbytes: int, h2d: float, d2h: float, reps: int, figures: dict) -> None:
    """The memory tier with its buffer on the GPU: each hop is staged through the host (slab.py)."""
    prefix = Prefix("LBNHC", tokens)
    with memory_cache(256, nbytes, device="cuda:0") as cache:
        stores, loads, same = store_and_load(cache, prefix, max(3, reps // 2))
    figures.update(gpu_tier_store_vs_limit=d2h / best(stores), gpu_tier_load_vs_limit=h2d / best(loads),
                   gpu_tier_identical=same)
    print(f"memory tier on the GPU (device cuda:0, chunk 256): store {d2h / best(stores):.2f} of the limit "
          f"({nbytes / best(stores) / 1e9:.1f} GB/s), load {h2d / best(loads):.2f} ({nbytes / best(loads) / 1e9:.1f} "
          f"GB/s), identical {same}")


def plot(rows, path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for layout, marker in (("LBNHC", "o"), ("BLNHC", "s")):
        sel = [r for r in rows if r[0] == layout]
        ax.plot([r[1] for r in sel], [r[2] for r in sel], marker=marker, label=f"store, {layout}")
        ax.plot([r[1] for r in sel], [r[3] for r in sel], marker=marker, linestyle="--", label=f"load, {layout}")
    ax.axhline(0.8, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size (tokens)")
    ax.set_ylabel("fraction of pinned cudaMemcpyAsync")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"GPU blocks <-> memory tier, 8B layout ({device})")
    ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
