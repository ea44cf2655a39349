"""Which on-disk layout for the disk tier: one file per chunk, or chunks appended to packed segment files?

Both sides get the same per-chunk durability (a chunk is on stable storage before it counts as stored):

* ``files``:    write a temp file, fsync it, rename it to its key, fsync the directory.
* ``segment``:  append the chunk to one open segment file, fdatasync it (an index record would still be needed
                on top; it is not counted, so this side is flattered).
* ``plain``:    the same bytes written sequentially to one file with a single fsync at the end: the ceiling.

Reads are timed after dropping the page cache where allowed (root: /proc/sys/vm/drop_caches), else with the
cache warm (said in the output). Deleting is timed too: a file is one unlink; a segment frees nothing until a
compaction rewrites its live chunks, which is the cost segments add. Run:

    python benchmarks/disk_layout.py [--dir DIR] [--total-mib 256]

Last line: ``RESULT {json}`` with, per chunk size, write and read throughput as fractions of plain.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import drop_caches, plain_read, plain_write  # noqa: E402


def write_files(root: str, data: memoryview, chunk: int) -> float:
    t = time.perf_counter()
    for i, off in enumerate(range(0, len(data), chunk)):
        sub = os.path.join(root, f"{i % 256:02x}")
        os.makedirs(sub, exist_ok=True)
        tmp, final = os.path.join(sub, f"{i:08d}.tmp"), os.path.join(sub, f"{i:08d}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data[off : off + chunk])
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, final)
        dfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
    return time.perf_counter() - t


def write_segment(path: str, data: memoryview, chunk: int) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    for off in range(0, len(data), chunk):
        os.write(fd, data[off : off + chunk])
        os.fdatasync(fd)
    os.close(fd)
    return time.perf_counter() - t


def read_files(root: str, n: int, chunk: int, threads: int) -> float:
    bufs = [bytearray(chunk) for _ in range(threads)]

    def one(i: int) -> None:
        fd = os.open(os.path.join(root, f"{i % 256:02x}", f"{i:08d}"), os.O_RDONLY)
        os.preadv(fd, [bufs[i % threads]], 0)
        os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
    return time.perf_counter() - t


def read_segment(path: str, n: int, chunk: int, threads: int) -> float:
    bufs = [bytearray(chunk) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: os.preadv(fd, [bufs[i % threads]], i * chunk), range(n)))
    elapsed = time.perf_counter() - t
    os.close(fd)
    return elapsed


def delete_files(root: str, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        os.unlink(os.path.join(root, f"{i % 256:02x}", f"{i:08d}"))
    return time.perf_counter() - t


def compact_segment(path: str, n: int, chunk: int) -> float:
    """Delete every other chunk: a segment must rewrite the live half to get the space back."""
    buf = bytearray(chunk)
    t = time.perf_counter()
    src = os.open(path, os.O_RDONLY)
    dst = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for i in range(0, n, 2):
        os.preadv(src, [buf], i * chunk)
        os.write(dst, buf)
    os.fsync(dst)
    os.close(src), os.close(dst)
    os.rename(path + ".new", path)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="directory on the filesystem to measure (default: a temp dir)")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, nargs="*", default=[256, 2048, 8192])
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="kvtier-layout-", dir=args.dir)
    total = args.total_mib << 20
    data = memoryview(os.urandom(total))
    result: dict[str, dict[str, float]] = {}
    dropped = False
    try:
        for kib in args.chunk_kib:
            chunk = kib << 10
            n = total // chunk
            plain, seg, files = (os.path.join(base, x) for x in ("plain", "segment", "files"))
            w_plain = plain_write(plain, (data[off : off + chunk] for off in range(0, len(data), chunk)))
            w_seg = write_segment(seg, data, chunk)
            w_files = write_files(files, data, chunk)
            dropped = drop_caches()
            r_plain = plain_read(plain, chunk)
            dropped = drop_caches() and dropped
            r_seg = read_segment(seg, n, chunk, args.threads)
            dropped = drop_caches() and dropped
            r_files = read_files(files, n, chunk, args.threads)
            d_files = delete_files(files, n)
            c_seg = compact_segment(seg, n, chunk)
            mib = total / (1 << 20)
            row = {
                "plain_write_mibs": mib / w_plain, "plain_read_mibs": mib / r_plain,
                "files_write_vs_plain": w_plain / w_files, "segment_write_vs_plain": w_plain / w_seg,
                "files_read_vs_plain": r_plain / r_files, "segment_read_vs_plain": r_plain / r_seg,
                "files_delete_half_s": d_files / 2, "segment_compact_half_s": c_seg,
            }
            result[f"{kib}KiB"] = {k: round(v, 3) for k, v in row.items()}
            print(f"chunk {kib:>6} KiB  " + "  ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)
            for p in (plain, seg):
                os.unlink(p)
            shutil.rmtree(files)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"page cache dropped before reads: {dropped}")
    print("RESULT " + json.dumps({"page_cache_dropped": dropped, **result}))


if __name__ == "__main__":
    main()
