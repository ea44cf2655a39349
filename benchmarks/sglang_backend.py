"""SGLang HiCache L3: kvtier's backend (memory, disk, Redis tiers) against SGLang's own ``HiCacheFile``, same pages.

A host pool of ``--pages`` pages (SGLang's ``layer_first`` layout, bf16, Llama-3-8B's KV at one rank: 32
layers x 8 KV heads x 128, so a 64-token page is 8 MiB; ``--layers/--heads/--head-dim`` for other shapes) is
filled once; every backend stores all pages from it (``batch_set_v1``; ``HiCacheFile`` through SGLang's older
path, ``get_data_page`` + ``batch_set``, which is how SGLang's cache controller drives it) and loads them back
into another region of the pool (``batch_get_v1``; ``HiCacheFile``: ``batch_get`` into flat pages, then
``set_from_flat_data_page`` as the controller does). Every load is checked bit-exact before it counts. Disk
reads are timed with the page cache dropped (``/proc/sys/vm/drop_caches`` where allowed, else
``posix_fadvise(DONTNEED)`` on every file of the backend). ``plain_copy`` is one ``copy_`` of the same pages
inside the pool: the ceiling for the memory tier. ``redis_raw_get`` is redis-py (hiredis) pipelined GET of
the same pages' bytes under other keys of the same server, one value per page: the ceiling for the Redis
tier, which also verifies each page and copies it into the pool. GB/s are best of ``--reps``; ratios against
those ceilings and against ``HiCacheFile``. Last line: ``RESULT {json}``.

SGLang's host pool classes do not import on a CPU-only machine (harness/sglang_pool.py says why),
so the pool is that module's ``HostPool``: the same tensor, in the same layout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best, evict_page_cache, result  # noqa: E402

from harness.sglang_pool import HostPool, backend, page_keys, storage_config  # noqa: E402


def timed(fn):
    """``(fn(), seconds)``."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _drop(path: str) -> None:
    evict_page_cache(path)


def raw_redis_gets(url: str, pool: HostPool, n: int, reps: int) -> list[float]:
    """Seconds of redis-py pipelined GETs of the ``n`` pages' bytes (set once under keys of their own)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=60)
    keys = [f"bench:raw:{i}".encode() for i in range(n)]
    pipe = client.pipeline(transaction=False)
    for i, key in enumerate(keys):
        pipe.set(key, pool.get_data_page(i * pool.page_size).view(torch.uint8).numpy().tobytes())
    pipe.execute()

    def get_all() -> None:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        got = pipe.execute()
        assert all(v is not None for v in got)

    seconds = [timed(get_all)[1] for _ in range(reps)]
    client.delete(*keys)
    client.close()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args()

    n, size = args.pages, args.page_size
    pool = HostPool("layer_first", pages=2 * n, page_size=size, layers=args.layers, heads=args.heads,
                    head_dim=args.head_dim)
    pool.fill(0)
    keys = page_keys(list(range(n * size)), size)
    src, dst = pool.host_indices(0, n), pool.host_indices(n, n)
    nbytes = pool.kv_buffer[:, :, : n * size].numel() * pool.dtype.itemsize
    want = pool.kv_buffer[:, :, : n * size]
    figures: dict[str, float | int | str] = {"pages": n, "page_size": size, "bytes": nbytes}

    def gbps(seconds: list[float]) -> float:
        return nbytes / best(seconds) / 1e9

    def check() -> None:
        if not torch.equal(pool.kv_buffer[:, :, n * size :], want):
            raise SystemExit("a load returned wrong pages")

    plain = [timed(lambda: pool.kv_buffer[:, :, n * size :].copy_(want))[1] for _ in range(args.reps)]
    figures["plain_copy_gbps"] = gbps(plain)

    workdir = tempfile.mkdtemp(prefix="kvtier-sglang-bench-")
    server = None
    tiers = {"memory": {"kind": "memory", "capacity_bytes": 2 * nbytes + (64 << 20)},
             "disk": {"kind": "disk", "path": f"{workdir}/kvtier", "capacity_bytes": 4 * nbytes,
                      "write_queue_depth": n}}  # the default 16 drops the rest of a 256-page batch (False)
    if not args.no_redis:
        from kvtier.net.ports import free_port
        from harness.redis_server import RedisServer

        server = RedisServer(port=free_port(), maxmemory="4gb").start()
        tiers["redis"] = {"kind": "redis", "url": server.url}
    try:
        for name, tier in tiers.items():
            sets, gets = [], []
            for rep in range(args.reps):
                store = backend(pool, {"tiers": [tier]}, model=f"bench-{name}-{rep}")
                sets.append(timed(lambda: store.batch_set_v1(keys, src))[1])
                for t in store.cache.tiers:
                    getattr(t, "flush", lambda: None)()
                if name == "disk":
                    _drop(tier["path"])
                pool.kv_buffer[:, :, n * size :].zero_()
                ok, seconds = timed(lambda: store.batch_get_v1(keys, dst))
                if not all(ok):
                    raise SystemExit(f"{name}: {ok.count(False)} pages missed")
                check()
                gets.append(seconds)
                store.close()
            figures[f"kvtier_{name}_set_gbps"], figures[f"kvtier_{name}_get_gbps"] = gbps(sets), gbps(gets)
        if server is not None:
            figures["redis_raw_get_gbps"] = gbps(raw_redis_gets(server.url, pool, n, args.reps))

        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        sets, gets = [], []
        for rep in range(args.reps):
            path = f"{workdir}/hicache-{rep}"
            hf = HiCacheFile(storage_config({"file_storage_path": path}, model=f"bench-file-{rep}"), file_path=path)
            sets.append(timed(lambda: hf.batch_set(keys, [pool.get_data_page(i * size) for i in range(n)]))[1])
            _drop(path)
            pool.kv_buffer[:, :, n * size :].zero_()

            def file_get() -> None:
                shape = pool.geometry.buffer_shape(size)
                pages = hf.batch_get(keys, [torch.empty(shape, dtype=pool.dtype).flatten() for _ in range(n)])
                for i, page in enumerate(pages):  # set_from_flat_data_page of layer_first
                    pool.kv_buffer[:, :, (n + i) * size : (n + i + 1) * size] = page.view(shape)

            gets.append(timed(file_get)[1])
            check()
        figures["hicache_file_set_gbps"], figures["hicache_file_get_gbps"] = gbps(sets), gbps(gets)
    finally:
        if server is not None:
            server.stop()
    plain_gbps = figures["plain_copy_gbps"]
    figures["memory_get_vs_plain_copy"] = figures["kvtier_memory_get_gbps"] / plain_gbps
    figures["memory_set_vs_plain_copy"] = figures["kvtier_memory_set_gbps"] / plain_gbps
    if "redis_raw_get_gbps" in figures:
        figures["redis_get_vs_raw_get"] = figures["kvtier_redis_get_gbps"] / figures["redis_raw_get_gbps"]
    figures["disk_get_vs_hicache_file"] = figures["kvtier_disk_get_gbps"] / figures["hicache_file_get_gbps"]
    figures["disk_set_vs_hicache_file"] = figures["kvtier_disk_set_gbps"] / figures["hicache_file_set_gbps"]
    for key, value in figures.items():
        print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    result(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
