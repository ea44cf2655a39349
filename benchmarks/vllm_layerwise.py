"""What loading layer by layer could save over whole-request loads in vLLM (issue 33, item 2).

vLLM lets a connector release a load layer by layer (``wait_for_layer_load`` before each attention layer), so a
request's own forward pass starts on layer 0 while later layers still arrive. kvtier stores a chunk as one blob
of every layer, verified as a whole, so no layer of a chunk can be released before the whole chunk was read and
verified; what a layerwise load could overlap with compute is only the scatter into vLLM's blocks of the layers
after the first. This measures, for a 4,096-token prefix of SmolLM2-135M's KV (30 layers, 3 KV heads of 64,
float32: 189 MB) loaded from the disk tier (page cache dropped) into vLLM's CPU paged layout, the connector's own
load path (``loader.retrieve_spec`` into ``PagedSink``):

* **whole load**: read, verify and scatter, as the asynchronous loads do today;
* **read + verify**: the same retrieve into a sink that discards the chunks (no scatter);
* **scatter**: the 16 verified chunks scattered into the blocks, from memory;
* **first layer ready, layerwise at best**: read + verify + one layer's share of the scatter.

The repetitions alternate and the fastest of each is kept (interference only adds time on a shared machine).
Output: a table, ``results/vllm_layerwise/vllm_layerwise.png``, and ``RESULT {json}`` with the ratio of the best
layerwise first-layer time to the whole load.

    python benchmarks/vllm_layerwise.py [--reps 5] [--out results/vllm_layerwise]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _util import best, result  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK, CHUNK, PREFIX = 30, 3, 64, 32, 256, 4096


class _Discard:
    """A KVSink that drops every chunk: the retrieve without the scatter."""

    def write(self, start: int, end: int, chunk) -> None:
        return


def _evict(folder: str) -> None:
    from _util import evict_page_cache

    evict_page_cache(folder)  # root drops the page cache, others evict the folder's files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="results/vllm_layerwise")
    args = parser.parse_args()
    import torch

    from kvtier.core.cache import KVCache
    from kvtier.integrations.vllm.config import ConnectorConfig
    from kvtier.integrations.vllm.loader import retrieve_spec
    from kvtier.integrations.vllm.metadata import LoadSpec, pack_tokens
    from kvtier.integrations.vllm.paged import PagedKV, PagedSink, PagedSource

    blocks = 2 * PREFIX // BLOCK
    store = torch.zeros(LAYERS, blocks, HEADS, BLOCK, 2 * HEAD_DIM)  # vLLM's CPU layout, one tensor per layer
    store.normal_()
    paged = PagedKV(list(store), BLOCK, rows_split=True)
    tokens = list(range(100, 100 + PREFIX))
    src_blocks, dst_blocks = list(range(PREFIX // BLOCK)), list(range(PREFIX // BLOCK, blocks))
    spec = LoadSpec("r", pack_tokens(tokens), b"", dst_blocks, 0, PREFIX, None)
    chunks = [paged.gather(src_blocks, s, s + CHUNK) for s in range(0, PREFIX, CHUNK)]
    times: dict[str, list[float]] = {"whole load": [], "read + verify": [], "scatter": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-layerwise-") as tmp, torch.inference_mode():
        config = ConnectorConfig.from_extra({"chunk_size": CHUNK, "tiers": [
            {"kind": "disk", "path": tmp, "capacity_bytes": "4GiB", "write_queue_depth": 64}]})
        cache = KVCache(paged.spec, "layerwise", config.cache)
        try:
            cache.store(tokens, PagedSource(paged, src_blocks))
            deadline = time.monotonic() + 60
            while cache.lookup(tokens) < PREFIX and time.monotonic() < deadline:
                time.sleep(0.1)  # the disk tier writes in the background
            for _ in range(args.reps):
                for label, sink in (("whole load", PagedSink(paged, dst_blocks, 0)), ("read + verify", _Discard())):
                    _evict(tmp)
                    start = time.perf_counter()
                    got = retrieve_spec(cache, spec, sink)
                    times[label].append(time.perf_counter() - start)
                    assert got == PREFIX, f"loaded {got} of {PREFIX} tokens"
                start = time.perf_counter()
                for i, chunk in enumerate(chunks):
                    paged.scatter(dst_blocks, i * CHUNK, chunk)
                times["scatter"].append(time.perf_counter() - start)
        finally:
            cache.close()
    fig = {label: best(v) for label, v in times.items()}
    fig["first layer ready (layerwise, best case)"] = fig["read + verify"] + fig["scatter"] / LAYERS
    ratio = fig["first layer ready (layerwise, best case)"] / fig["whole load"]
    load = os.getloadavg()[0]
    print(f"{PREFIX}-token prefix, {LAYERS} layers, disk tier (page cache dropped), best of {args.reps}; "
          f"load average {load:.1f}")
    for label, seconds in fig.items():
        print(f"  {label:<42} {seconds * 1000:8.1f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _plot(fig, out / "vllm_layerwise.png")
    result({"benchmark": "vllm_layerwise", "whole_load_ms": fig["whole load"] * 1000,
            "read_verify_ms": fig["read + verify"] * 1000, "scatter_ms": fig["scatter"] * 1000,
            "first_layer_vs_whole": ratio, "most_saved_share": 1 - ratio, "loadavg_1m": round(load, 2)})


def _plot(fig: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = plt.figure(figsize=(8, 3.6)).gca()
    ax.barh(list(fig)[::-1], [v * 1000 for v in fig.values()][::-1], color="#37c")
    ax.set(xlabel="ms", title=f"{PREFIX}-token prefix from the disk tier: whole load vs layer by layer")
    ax.grid(True, axis="x", alpha=0.3)
    plt.tight_layout()
    plt.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
