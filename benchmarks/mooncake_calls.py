"""Which Mooncake Store Python calls move 1-32 MiB values fastest over TCP: the measurement behind the tier's
choice of ``batch_put_from`` / ``batch_get_into`` on registered buffers.

A real ``mooncake_master`` and a second process contributing the pool's memory (this process contributes
none, so every byte crosses the transfer engine, as it does between replicas); per value size, 256 MiB of
values stored and read back with each call, repetitions interleaved, best and median kept:

* put: ``put_batch`` (bytes-like values, copied into the client's local buffer first) and ``batch_put_from``
  (zero-copy from a registered buffer);
* get: ``get_batch`` (new ``bytes`` per value), ``batch_get_buffer`` (handles into the client's local
  buffer), ``batch_get_into`` (zero-copy into a registered buffer, sizes known) and ``batch_get_into`` after
  ``batch_get_replica_desc`` (sizes looked up first: what a reader that does not know them does).

Throughput is printed as GB/s and as a ratio to a plain memcpy of the same bytes. ``--local`` makes this
process contribute the pool instead (every transfer a local copy). Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best, median, result, timed  # noqa: E402

MiB = 1 << 20
PUTS = ("put_batch", "batch_put_from")
GETS = ("get_batch", "batch_get_buffer", "batch_get_into", "batch_get_into+desc")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="1,4,8,32")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--local", action="store_true", help="this process holds the pool (local copies)")
    args = ap.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from harness.mooncake_master import MooncakeMaster, SegmentHost

    total = args.total_mib * MiB
    with MooncakeMaster() as master:
        pool = 2 * total + 64 * MiB
        host = None if args.local else SegmentHost(master, pool)
        try:
            figures = run(args, master, total, pool if args.local else 0)
        finally:
            if host is not None:
                host.stop()
    result(figures)
    return 0


def run(args: argparse.Namespace, master, total: int, own_segment: int) -> dict:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", master.metadata_url, own_segment, total + 64 * MiB, "tcp", "",
                     master.master_address)
    if rc != 0:
        raise RuntimeError(f"mooncake setup failed: {rc}")
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    for arr in (src, dst):
        if store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
    memcpy = total / best(timed(lambda: np.copyto(dst, src), 5)) / 1e9
    print(f"memcpy of {total // MiB} MiB: {memcpy:.2f} GB/s; pool {'here' if own_segment else 'in another process'}")
    figures: dict = {"memcpy_gbps": memcpy, "local": bool(own_segment), "reps": args.reps}
    print(f"{'value MiB':>9}  {'call':<22}{'best GB/s':>10}{'median':>8}{'/ memcpy':>10}")
    for size_mib in [int(s) for s in args.sizes_mib.split(",")]:
        gbps = measure(store, src, dst, size_mib * MiB, args.reps)
        for call, (top, mid) in gbps.items():
            print(f"{size_mib:>9}  {call:<22}{top:>10.2f}{mid:>8.2f}{top / memcpy:>10.2f}")
            figures[f"{call}_{size_mib}mib_gbps"] = top
    store.close()
    return figures


def measure(store, src: np.ndarray, dst: np.ndarray, size: int, reps: int) -> dict[str, tuple[float, float]]:
    n = src.nbytes // size
    keys = [f"bench:{size}:{i}" for i in range(n)]
    ptrs = [src.ctypes.data + i * size for i in range(n)]
    dptrs = [dst.ctypes.data + i * size for i in range(n)]
    sizes = [size] * n
    views = [memoryview(src)[i * size : (i + 1) * size] for i in range(n)]

    def clear() -> None:
        store.batch_remove(keys, True)

    def put_batch() -> None:
        check(store.put_batch(keys, views) == 0, "put_batch")

    def batch_put_from() -> None:
        check(all(c == 0 for c in store.batch_put_from(keys, ptrs, sizes)), "batch_put_from")

    def get_batch() -> None:
        check(all(len(v) == size for v in store.get_batch(keys)), "get_batch")

    def batch_get_buffer() -> None:
        check(all(h is not None and h.size() == size for h in store.batch_get_buffer(keys)), "batch_get_buffer")

    def batch_get_into() -> None:
        check(all(c == size for c in store.batch_get_into(keys, dptrs, sizes)), "batch_get_into")

    def batch_get_into_desc() -> None:
        descs = store.batch_get_replica_desc(keys)
        found = [descs[k][0].get_memory_descriptor().buffer_descriptor.size for k in keys]
        check(all(c == size for c in store.batch_get_into(keys, dptrs, found)), "batch_get_into+desc")

    puts = {"put_batch": put_batch, "batch_put_from": batch_put_from}
    gets = {"get_batch": get_batch, "batch_get_buffer": batch_get_buffer, "batch_get_into": batch_get_into,
            "batch_get_into+desc": batch_get_into_desc}
    times: dict[str, list[float]] = {name: [] for name in (*puts, *gets)}
    clear()
    batch_put_from()
    dst[:] = 0
    batch_get_into()
    check(np.array_equal(src, dst), "bytes read back differ")
    for rep in range(reps):  # interleaved, the order flipped every round
        order = list(gets.items()) if rep % 2 else list(reversed(gets.items()))
        for name, fn in order:
            times[name] += timed(fn, 1)
        for name, fn in (list(puts.items()) if rep % 2 else list(reversed(puts.items()))):
            times[name] += timed(fn, 1, setup=clear)
    clear()
    batch_put_from()  # leave the store as the gets found it
    clear()
    return {name: (src.nbytes / best(t) / 1e9, src.nbytes / median(t) / 1e9) for name, t in times.items()}


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"{what}: unexpected result")


if __name__ == "__main__":
    sys.exit(main())
