"""Redis tier throughput and lookup latency against raw redis-py, in the same run, on the same server.

* retrieve: ``KVCache.retrieve`` of a 512 MiB prefix (16 chunks of 32 MiB: 32 layers, 8 KV heads, head_dim 128,
  bf16, chunk_size 256) from a KVCache whose only tier is Redis, into a reused output tensor. That includes
  the existence check, both round trips, checksum verification of every chunk and the copy into the output.
  Compared with raw redis-py (hiredis parser) pipelined GET of the same stored bytes, one value per chunk.
  The tier alone (``tier.get``, no verification or copy-out) is reported too.
* store: ``KVCache.store`` of the same prefix (existence check, encode, seal, split, send) vs raw redis-py
  pipelined SET of the already encoded values.
* lookup: ``KVCache.lookup`` of a 128k-token prompt whose 512 chunks are all in the store (hash 128k tokens,
  one pipelined EXISTS per chunk).
* clients: the tier's hand-written RESP path (``tier.get``) against the two maintained clients it could use
  instead, on the same values: redis-py with hiredis (pipelined GET/SET) and valkey-glide (its Rust core,
  sync client, non-atomic Batch of GET/SET), when ``valkey-glide-sync`` is installed.

Starts its own redis-server (persistence off) on a loopback TCP port, which every client uses (valkey-glide
speaks TCP only), unless ``--url`` is given. Ratios are
throughput through kvtier / raw throughput (higher is better; the target is >= 0.8), from the best of
interleaved repetitions on both sides (on a shared machine, interference only adds time); medians are printed
too. Lookup is the median over a numpy token array and over a Python list. Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best, median, result, timed  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.base.keys import token_array  # noqa: E402
from kvtier.codecs.blob import blob_bytes, encode_blob  # noqa: E402
from kvtier.tiers import RedisTierConfig  # noqa: E402

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an existing server, redis://host:port (default: start one on a loopback port)")
    ap.add_argument("--prefix-mib", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--part-mib", type=int, default=8, help="the tier's max_part_bytes")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--lookup-tokens", type=int, default=128 * 1024)
    args = ap.parse_args()

    import redis
    import redis.utils

    server = None
    url = args.url
    if url is None:
        from kvtier.net.ports import free_port
        from harness.redis_server import RedisServer

        server = RedisServer(port=free_port(), maxmemory="4gb").start()
        url = server.tcp_url
    try:
        figures = run(args, url, redis)
        figures["hiredis"] = bool(redis.utils.HIREDIS_AVAILABLE)
    finally:
        if server is not None:
            server.stop()
    result(figures)
    return 0


def run(args: argparse.Namespace, url: str, redis) -> dict:
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    chunk = args.chunk_size
    chunk_bytes = spec.bytes_per_token * chunk
    n_chunks = max(1, args.prefix_mib * MiB // chunk_bytes)
    n_tokens = n_chunks * chunk
    print(f"prefix: {n_tokens} tokens, {n_chunks} chunks of {chunk_bytes / MiB:.0f} MiB, "
          f"{n_chunks * chunk_bytes / MiB:.0f} MiB; parts of {args.part_mib} MiB; server {url}")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100_000, (n_tokens,), generator=gen)
    kv = torch.randn(spec.chunk_shape(n_tokens), generator=gen).to(spec.dtype)
    tier_cfg = RedisTierConfig(url=url, max_part_bytes=args.part_mib * MiB, timeout_s=2.0,
                               buffer_pool_bytes=2 * n_chunks * chunk_bytes + 256 * MiB)
    cache = KVCache(spec, "bench-model", CacheConfig(chunk_size=chunk, tiers=(tier_cfg,)))
    tier = cache.tiers[0]
    keys = cache.keys(tokens)
    ids = token_array(tokens)
    # the exact bytes the tier stores, as raw redis-py values under other keys
    values = [bytes(blob_bytes(encode_blob(k, ids[i * chunk : (i + 1) * chunk], tier.codec,
                                           kv[:, :, i * chunk : (i + 1) * chunk])))
              for i, k in enumerate(keys)]
    total = sum(len(v) for v in values)
    client = redis.Redis.from_url(url, socket_timeout=60)
    raw_keys = [f"bench:raw:{i}".encode() for i in range(n_chunks)]

    def raw_set() -> None:
        pipe = client.pipeline(transaction=False)
        for k, v in zip(raw_keys, values):
            pipe.set(k, v)
        pipe.execute()

    def raw_get() -> None:
        pipe = client.pipeline(transaction=False)
        for k in raw_keys:
            pipe.get(k)
        got = pipe.execute()
        assert len(got[-1]) == len(values[-1])

    def kv_store() -> None:
        assert cache.store(tokens, kv) == n_tokens

    out = spec.empty(n_tokens)

    def kv_retrieve() -> None:
        assert cache.retrieve(tokens, out)[1] == n_tokens

    def tier_get() -> None:
        with tier.get(keys) as got:
            assert all(v is not None for v in got)

    def clear_raw() -> None:
        client.unlink(*raw_keys)

    glide = glide_client(url)

    def glide_set() -> None:
        batch = glide.Batch(is_atomic=False)
        for k, v in zip(raw_keys, values):
            batch.set(k, v)
        glide.client.exec(batch, raise_on_error=True)

    def glide_get() -> None:
        batch = glide.Batch(is_atomic=False)
        for k in raw_keys:
            batch.get(k)
        got = glide.client.exec(batch, raise_on_error=True)
        assert len(got[-1]) == len(values[-1])

    def clear_tier() -> None:
        tier.delete(keys)

    # warm up both paths once (connections, buffers, page faults of the output tensor)
    raw_set()
    kv_store()
    raw_get()
    kv_retrieve()
    tier_get()
    assert torch.equal(out, kv)
    runs = [("raw GET (redis-py)", "raw_get", raw_get, None), ("retrieve (KVCache)", "kv_retrieve", kv_retrieve, None),
            ("get (tier alone)", "tier_get", tier_get, None), ("raw SET (redis-py)", "raw_set", raw_set, clear_raw),
            ("store (KVCache)", "kv_store", kv_store, clear_tier)]
    if glide is not None:
        glide_set()
        glide_get()
        runs += [("raw GET (valkey-glide)", "glide_get", glide_get, None),
                 ("raw SET (valkey-glide)", "glide_set", glide_set, clear_raw)]
    times: dict[str, list[float]] = {key: [] for _, key, _, _ in runs}
    for _ in range(args.reps):  # interleaved, so both sides see the same machine load
        for _label, key, fn, setup in runs:
            times[key] += timed(fn, 1, setup=setup)
    gbps = {k: total / best(v) / 1e9 for k, v in times.items()}
    print(f"{'operation':<22}{'best ms':>10}{'median ms':>11}{'GB/s':>8}")
    for label, key, _, _ in runs:
        print(f"{label:<22}{best(times[key]) * 1e3:>10.1f}{median(times[key]) * 1e3:>11.1f}{gbps[key]:>8.2f}")
    clear_raw()
    clear_tier()
    cache.close()
    if glide is not None:
        glide.client.close()

    lookup_ms = lookup_latency(url, args.lookup_tokens, chunk)
    return {
        "retrieve_vs_raw": gbps["kv_retrieve"] / gbps["raw_get"],
        "store_vs_raw": gbps["kv_store"] / gbps["raw_set"],
        "lookup_128k_ms": lookup_ms["array"],
        "lookup_128k_list_ms": lookup_ms["list"],
        "tier_get_vs_raw": gbps["tier_get"] / gbps["raw_get"],
        **client_ratios(gbps),
        "retrieve_gbps": gbps["kv_retrieve"],
        "raw_get_gbps": gbps["raw_get"],
        "store_gbps": gbps["kv_store"],
        "raw_set_gbps": gbps["raw_set"],
        "prefix_mib": total / MiB,
        "chunk_mib": chunk_bytes / MiB,
        "part_mib": args.part_mib,
        "reps": args.reps,
        "path": "KVCache with a redis tier only (tier_get_vs_raw: RedisTier.get alone)",
    }


class _Glide:
    def __init__(self, client, batch_cls) -> None:
        self.client, self.Batch = client, batch_cls


def glide_client(url: str) -> _Glide | None:
    """A valkey-glide sync client on the server of ``url`` (TCP), or None when glide is not installed."""
    try:
        from glide_sync import Batch, GlideClient, GlideClientConfiguration, NodeAddress
    except ImportError:
        print("valkey-glide-sync is not installed: no glide figures (pip install valkey-glide-sync)")
        return None
    from urllib.parse import urlparse

    where = urlparse(url)
    config = GlideClientConfiguration([NodeAddress(where.hostname, where.port)], request_timeout=60_000)
    return _Glide(GlideClient.create(config), Batch)


def client_ratios(gbps: dict[str, float]) -> dict[str, float]:
    """The hand-written RESP path (tier get) and KVCache store against each maintained client."""
    out = {"tier_get_vs_redis_py": gbps["tier_get"] / gbps["raw_get"]}
    if "glide_get" in gbps:
        out.update(tier_get_vs_glide=gbps["tier_get"] / gbps["glide_get"],
                   glide_get_vs_redis_py=gbps["glide_get"] / gbps["raw_get"],
                   glide_set_vs_redis_py=gbps["glide_set"] / gbps["raw_set"],
                   store_vs_glide=gbps["kv_store"] / gbps["glide_set"],
                   glide_get_gbps=gbps["glide_get"], glide_set_gbps=gbps["glide_set"])
    return out


def lookup_latency(url: str, n_tokens: int, chunk: int) -> dict[str, float]:
    """Median ms of KVCache.lookup of a prompt whose chunks are all stored (a full hit: every chunk asked)."""
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16)  # values barely matter here
    cache = KVCache(spec, "bench-lookup", CacheConfig(chunk_size=chunk, tiers=(RedisTierConfig(url=url),)))
    tokens = np.random.default_rng(1).integers(0, 100_000, n_tokens, dtype=np.uint32)
    as_list = tokens.tolist()
    cache.store(tokens, torch.zeros(spec.chunk_shape(n_tokens), dtype=spec.dtype))
    assert cache.lookup(tokens) == n_tokens // chunk * chunk
    array_ms = median(timed(lambda: cache.lookup(tokens), 30)) * 1e3
    list_ms = median(timed(lambda: cache.lookup(as_list), 15)) * 1e3
    cache.tiers[0].delete(cache.keys(tokens))
    cache.close()
    print(f"lookup of {n_tokens} tokens ({n_tokens // chunk} chunks), median: numpy array {array_ms:.2f} ms, "
          f"Python list {list_ms:.2f} ms")
    return {"array": array_ms, "list": list_ms}


if __name__ == "__main__":
    sys.exit(main())
