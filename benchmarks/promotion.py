"""Promotion during a load against promotion after it: what a retrieve from a disk tier below a memory tier costs.

A load hands the chunks it finds below the first tier to the tier chain while their memory is valid (the
``Promoter`` callback of kvtier/core/pipeline.py: inside the slower tier's ``get`` block, from the worker that
decoded them). The alternative is a pipeline that only reports what it loaded and a chain that promotes once the
load has returned; the decoded chunks are then gone (a worker's scratch chunk is decoded into again, a raw blob's
pin is released, a sink such as the vLLM connector's keeps no CPU copy), so the chain must either keep copies or
read the chunks from the tier again. Four ways of the same retrieve, on the same chunks, in one run:

* ``callback``: the pipeline as it is.
* ``after_copies``: the load keeps a copy of each chunk it found below; the chain promotes them after it returns.
  ``after_copies_return_s`` is when a retrieve could return if that promotion ran in the background instead.
* ``after_reread``: the load promotes nothing; the chain reads the chunks from the tier again and promotes them.
* ``no_promotion``: the load alone, the floor.

A prefix of ``--tokens`` tokens of a Llama-3.2-1B-shaped model's KV (32 KiB a token, 256-token chunks) is stored
on a disk tier; each round opens a new cache of an empty memory tier over that disk tier, evicts the files from
the page cache (or drops it, as root), and retrieves the prefix into a sink, timing ``KVCache.retrieve`` to its
return. Two sinks: ``writing`` copies each chunk into memory of its own (as the vLLM connector's host sink does;
the pipeline decodes into a scratch chunk first) and ``lending`` lends its tensor (``TensorSink``: the pipeline
decodes into it). After every promoting round the memory tier must hold the whole prefix and the sink the
stored KV. Variants run interleaved; each figure is the best round (interference only adds time).

Last line: ``RESULT {json}`` with the best seconds of each variant and sink, the ratios against ``callback``,
and the bytes the ``after_copies`` way holds during a load. Run: ``python benchmarks/promotion.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best, evict_page_cache, result  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.base.keys import token_array  # noqa: E402
from kvtier.codecs.blob import decode_blob  # noqa: E402
from kvtier.core.events import EntryKind  # noqa: E402
from kvtier.core.jobs import Entry, LoadJob  # noqa: E402
from kvtier.tiers import DiskTierConfig, MemoryTierConfig  # noqa: E402

SPEC = KVSpec(num_layers=16, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16)  # Llama-3.2-1B-like
CHUNK_TOKENS = 256
VARIANTS = ("callback", "after_copies", "after_reread", "no_promotion")


class WritingSink:
    """A KVSink that lends no memory: each chunk is copied into a tensor of its own (as an engine's sink copies
    into its paged blocks), so the pipeline decodes into a scratch chunk first."""

    concurrent_writes = True

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        self.out[:, :, start:end].copy_(chunk)


class LendingSink(WritingSink):
    """A KVSink that lends its tensor (``TensorSink``): chunks are decoded straight into it."""

    def destination(self, start: int, end: int) -> torch.Tensor:
        return self.out[:, :, start:end]


class KeepCopies:
    """A Promoter that copies what a load hands it, for the chain to promote after the load."""

    def __init__(self) -> None:
        self.found: list[tuple[int, list[Entry]]] = []
        self.nbytes = 0

    def promote(self, found_in: int, entries) -> None:
        copies = [Entry(e.key, e.tokens, e.tensor.clone()) for e in entries]
        self.nbytes += sum(e.tensor.nbytes for e in copies)
        self.found.append((found_in, copies))


def install(cache: KVCache, variant: str, timings: dict) -> None:
    """Make ``cache``'s loads promote the ``variant`` way (the pipeline's ``load`` wrapped; nothing else changes)."""
    pipeline, chain = cache.chain.pipeline, cache.chain
    load = pipeline.load

    def after_copies(job: LoadJob):
        kept = KeepCopies()
        out = load(LoadJob(job.tiers, job.keys, job.where, job.token_ids, job.sink, kept))
        timings["return_s"] = time.perf_counter()
        for found_in, entries in kept.found:
            job.promoter.promote(found_in, entries)
        timings["held_bytes"] = kept.nbytes
        return out

    def after_reread(job: LoadJob):
        out = load(LoadJob(job.tiers, job.keys, job.where, job.token_ids, job.sink, None))
        size = pipeline.chunk_size
        below = {job.keys[i]: job.token_ids[i * size:(i + 1) * size]
                 for i, (w, ok) in enumerate(zip(job.where, out.ok)) if ok and w}
        chain.read(below, reread_decode, EntryKind.CHUNK)  # the fastest holder first: the disk tier; promotes
        return out

    def no_promotion(job: LoadJob):
        return load(LoadJob(job.tiers, job.keys, job.where, job.token_ids, job.sink, None))

    wrappers: dict[str, Callable] = {"after_copies": after_copies, "after_reread": after_reread,
                                     "no_promotion": no_promotion}
    if variant in wrappers:
        pipeline.load = wrappers[variant]


def reread_decode(tier, key, blob, tokens) -> torch.Tensor:
    """A chunk read again, verified and copied out of the blob (its pin ends with the get)."""
    chunk = decode_blob(blob, key, tokens, codec=tier.codec, verify=tier.verifies,
                        expect=(SPEC.chunk_shape(CHUNK_TOKENS), SPEC.dtype))
    return chunk.clone()


def one_round(disk: DiskTierConfig, memory: MemoryTierConfig, tokens: list[int], kv: torch.Tensor, variant: str,
              sink_cls: type[WritingSink]) -> dict:
    """One retrieve of ``tokens`` from the disk tier under an empty memory tier; its seconds, checked."""
    evict_page_cache(disk.path)
    out = torch.empty_like(kv)
    timings: dict = {}
    with KVCache(SPEC, "bench-model@1", CacheConfig(chunk_size=CHUNK_TOKENS, tiers=(memory, disk))) as cache:
        install(cache, variant, timings)
        start = time.perf_counter()
        _, n = cache.retrieve(tokens, sink_cls(out))
        seconds = time.perf_counter() - start
        assert n == len(tokens), (variant, n)
        assert torch.equal(out, kv), variant
        where = cache.locate(cache.keys(token_array(tokens)))
        expected = [1] * len(where) if variant == "no_promotion" else [0] * len(where)
        assert where == expected, (variant, where)  # promoted: the memory tier holds the whole prefix
    figures = {"s": seconds}
    if "return_s" in timings:
        figures["return_s"] = timings["return_s"] - start
        figures["held_bytes"] = timings["held_bytes"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="prefix length (a multiple of 256)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tier lives (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="2,048 tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.rounds = 2048, 2
    tokens = np.random.default_rng(0).integers(100, 32000, size=args.tokens).tolist()
    kv = torch.randn(SPEC.chunk_shape(args.tokens)).to(SPEC.dtype)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        disk = DiskTierConfig(path=Path(root), capacity_bytes=4 * kv.nbytes, fsync=False)
        memory = MemoryTierConfig(capacity_bytes=2 * kv.nbytes)
        with KVCache(SPEC, "bench-model@1", CacheConfig(chunk_size=CHUNK_TOKENS, tiers=(disk,))) as cache:
            cache.store(tokens, kv)
            cache.tiers[0].flush()
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.rounds):
            for sink in (WritingSink, LendingSink):
                for variant in VARIANTS:
                    runs.setdefault((sink.__name__, variant), []).append(
                        one_round(disk, memory, tokens, kv, variant, sink))
    figures: dict = {"tokens": args.tokens, "kv_mib": kv.nbytes / 2**20, "rounds": args.rounds,
                     "torch_threads": torch.get_num_threads()}
    for sink in ("WritingSink", "LendingSink"):
        name = sink.removesuffix("Sink").lower()
        base = best([r["s"] for r in runs[(sink, "callback")]])
        for variant in VARIANTS:
            s = best([r["s"] for r in runs[(sink, variant)]])
            figures[f"{name}_{variant}_s"] = s
            figures[f"{name}_{variant}_vs_callback"] = s / base
            print(f"{name:8s} sink  {variant:13s} {s * 1000:8.1f} ms  ({s / base:.2f}x callback)", flush=True)
        kept = runs[(sink, "after_copies")]
        figures[f"{name}_after_copies_return_s"] = best([r["return_s"] for r in kept])
        figures[f"{name}_after_copies_held_mib"] = kept[0]["held_bytes"] / 2**20
        print(f"{name:8s} sink  after_copies returns after {figures[f'{name}_after_copies_return_s'] * 1000:.1f} ms "
              f"(promotion in the background), holding {figures[f'{name}_after_copies_held_mib']:.0f} MiB of copies",
              flush=True)
    result(figures)


if __name__ == "__main__":
    main()
