"""kvtier against LMCache on this machine: the same KV stored into and retrieved from RAM and from local disk.

The KV is SmolLM2-135M-shaped (30 layers x 3 KV heads x 64, bf16: 22.5 KiB per token), ``--tokens`` long
(4,096 by default: 90 MiB in 16 chunks of 256 tokens), made from one seed on both sides and checked equal by
its SHA-256 before anything is timed. kvtier runs here: a KVCache whose only tier is the memory tier, and one
whose only tier is the disk tier (O_DIRECT, each chunk fsynced before it is visible, as shipped). LMCache runs
its in-process engine (``LMCacheEngine.store`` / ``retrieve``) with its ``LocalCPUBackend`` (RAM) and, in a
second engine, its ``LocalDiskBackend`` alone, in its own interpreter: installing LMCache into kvtier's
environment would change installed versions (scripts/lmcache-venv.sh says which and builds that interpreter).
benchmarks/_alternatives_lmcache.py is its half and says how the KV reaches LMCache's engine on a CPU; only
JSON numbers cross between the two processes.

Each round stores the whole KV into an empty tier and retrieves it into a reused tensor, checked bit-exact; the
rounds of the four arms (kvtier / LMCache x memory / disk) are interleaved, their order reversed every other
round. Disk reads are timed with the page cache dropped (as benchmarks/_util.evict_page_cache). Disk stores
count until the last chunk is visible: kvtier's are fsynced by then, LMCache's are not (its backend writes
without fsync), so LMCache's fsync of its files is timed too and shown added. Each process also times one plain
``copy_`` of the same bytes per round: its own limit; LMCache's side also times its connector's chunk copies
alone, which separates what LMCache's engine adds from the copy a CPU connector makes. Figures: best and median
of ``--rounds`` (interference on a shared machine only adds time); ratios > 1 mean kvtier is faster. The other
peers measured by this project on this machine are not rerun here: SGLang's ``HiCacheFile``
(benchmarks/sglang_backend.py) and raw Mooncake Store calls (benchmarks/mooncake_tier.py);
docs/benchmarks/alternatives.md links their records. Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _alternatives_lmcache import kv_digest, make_kv  # noqa: E402  (torch only: the same KV on both sides)
from _util import best, evict_page_cache, median, result, stop_children_on_signal  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
SEED = 0
ARMS = [("kvtier", "memory"), ("lmcache", "memory"), ("kvtier", "disk"), ("lmcache", "disk")]
SETUP_HINT = "set it up with: bash scripts/lmcache-venv.sh [DIR], then pass --lmcache-python DIR/bin/python"


class LMCacheSide:
    """LMCache's half, a subprocess speaking JSON lines (benchmarks/_alternatives_lmcache.py)."""

    def __init__(self, python: str, args, base: Path) -> None:
        if not Path(python).is_file():
            raise SystemExit(f"no LMCache interpreter at {python}; {SETUP_HINT}")
        self.log_path = base / "lmcache.log"
        cmd = [python, str(HERE / "_alternatives_lmcache.py"), "--tokens", str(args.tokens),
               "--layers", str(LAYERS), "--heads", str(HEADS), "--head-dim", str(HEAD_DIM),
               "--chunk-size", str(args.chunk_size), "--seed", str(SEED), "--rounds", str(args.rounds),
               "--dir", str(base)]
        if args.lmcache_odirect:
            cmd.append("--odirect")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.hello = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"LMCache's side exited ({self.proc.wait()}); its log ends:\n{tail}\n{SETUP_HINT}")
        return json.loads(line)

    def round(self, tier: str) -> dict:
        self.proc.stdin.write(json.dumps({"op": "round", "tier": tier}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class KVTierSide:
    """kvtier's two caches over the same KV (canonical layout ``[layers, 2, tokens, heads, head_dim]``)."""

    def __init__(self, kv_lmcache_layout: torch.Tensor, args, base: Path) -> None:
        tokens = kv_lmcache_layout.shape[2]
        self.kv = kv_lmcache_layout.view(2, LAYERS, tokens, HEADS, HEAD_DIM).permute(1, 0, 2, 3, 4).contiguous()
        self.tokens = np.arange(tokens, dtype=np.uint32)
        self.out, self.scratch = torch.zeros_like(self.kv), torch.zeros_like(self.kv)
        spec = KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16)
        capacity = 2 * self.kv.numel() * self.kv.element_size()
        chunks = tokens // args.chunk_size
        self.disk_dir = base / "kvtier-disk"
        self.caches = {
            "memory": KVCache(spec, "bench/smollm2-shape", CacheConfig(
                chunk_size=args.chunk_size, tiers=[{"kind": "memory", "capacity_bytes": capacity}])),
            # A queue as deep as the prompt's chunks: the benchmark times writes, not the tier's drop policy.
            "disk": KVCache(spec, "bench/smollm2-shape", CacheConfig(
                chunk_size=args.chunk_size, tiers=[{"kind": "disk", "path": str(self.disk_dir),
                                                    "capacity_bytes": capacity, "write_queue_depth": chunks}])),
        }

    def round(self, tier: str) -> dict:
        cache = self.caches[tier]
        keys = cache.keys(self.tokens)
        start = time.perf_counter()
        self.scratch.copy_(self.kv)
        figures = {"copy_s": time.perf_counter() - start}
        start = time.perf_counter()
        cache.store(self.tokens, self.kv)
        if tier == "disk":
            cache.tiers[0].flush()  # a chunk is visible only once fsynced and renamed
        figures["store_s"] = time.perf_counter() - start
        if tier == "disk":
            figures["page_cache"] = evict_page_cache(self.disk_dir)
        self.out.zero_()
        start = time.perf_counter()
        _, hit = cache.retrieve(self.tokens, self.out)
        figures["retrieve_s"] = time.perf_counter() - start
        figures["hit_tokens"], figures["exact"] = int(hit), bool(torch.equal(self.out, self.kv))
        cache.tiers[0].delete(keys)  # the next round stores afresh
        return figures

    def close(self) -> None:
        for cache in self.caches.values():
            cache.close()


def run_rounds(sides: dict, rounds: int, tokens: int) -> dict:
    """``{(side, tier): [round figures]}``, the arms interleaved; stops at the first wrong or short retrieve."""
    runs: dict = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for side, tier in (ARMS if r % 2 == 0 else ARMS[::-1]):
            figures = sides[side].round(tier)
            if not figures["exact"] or figures["hit_tokens"] != tokens or figures.get("files_left", 0):
                raise SystemExit(f"{side} {tier} round {r}: {figures} (retrieve not whole and bit-exact)")
            runs[(side, tier)].append(figures)
        print(f"round {r + 1}/{rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    return runs


def summarise(runs: dict, nbytes: int) -> dict:
    """GB/s (best, median) per arm and phase, and kvtier-over-LMCache ratios of the same."""
    out: dict = {}
    for (side, tier), rows in runs.items():
        phases = ["copy_s", "store_s", "retrieve_s"]
        if side == "lmcache":
            phases += ["connector_store_s", "connector_retrieve_s"]
        if side == "lmcache" and tier == "disk":
            for row in rows:
                row["store_fsync_s"] = row["store_s"] + row["fsync_s"]
            phases.append("store_fsync_s")
        for phase in phases:
            values = [row[phase] for row in rows]
            name = f"{side}_{tier}_{phase[:-2]}"
            out[name + "_gbps"] = nbytes / best(values) / 1e9
            out[name + "_median_gbps"] = nbytes / median(values) / 1e9
    for tier in ("memory", "disk"):
        for phase in ("store", "retrieve"):
            for stat in ("", "_median"):
                out[f"{tier}_{phase}{stat}_ratio"] = (out[f"kvtier_{tier}_{phase}{stat}_gbps"]
                                                      / out[f"lmcache_{tier}_{phase}{stat}_gbps"])
        for side in ("kvtier", "lmcache"):  # each against the plain copy in its own process
            for phase in ("store", "retrieve"):
                out[f"{side}_{tier}_{phase}_vs_copy"] = (out[f"{side}_{tier}_{phase}_gbps"]
                                                         / out[f"{side}_{tier}_copy_gbps"])
    out["disk_store_ratio_lmcache_fsynced"] = out["kvtier_disk_store_gbps"] / out["lmcache_disk_store_fsync_gbps"]
    return out


def report(figures: dict) -> None:
    for tier in ("memory", "disk"):
        for phase in ("store", "retrieve"):
            kv, lm = figures[f"kvtier_{tier}_{phase}_gbps"], figures[f"lmcache_{tier}_{phase}_gbps"]
            print(f"{tier:6} {phase:8}  kvtier {kv:6.2f} GB/s  LMCache {lm:6.2f} GB/s  kvtier/LMCache "
                  f"{figures[f'{tier}_{phase}_ratio']:.2f} (median {figures[f'{tier}_{phase}_median_ratio']:.2f})")
    print(f"LMCache's connector copies alone (torch copy_ of each chunk's token range): store "
          f"{figures['lmcache_memory_connector_store_gbps']:.2f} GB/s, retrieve "
          f"{figures['lmcache_memory_connector_retrieve_gbps']:.2f} GB/s; one flat copy in its process "
          f"{figures['lmcache_memory_copy_gbps']:.2f} GB/s")
    print(f"disk store with LMCache's files fsynced as kvtier's are: {figures['lmcache_disk_store_fsync_gbps']:.2f}"
          f" GB/s, kvtier/LMCache {figures['disk_store_ratio_lmcache_fsynced']:.2f}")
    print("not rerun here: SGLang HiCacheFile (benchmarks/sglang_backend.py), raw Mooncake Store "
          "(benchmarks/mooncake_tier.py); see docs/benchmarks/alternatives.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where both sides' disk tiers go (default: a temp dir)")
    ap.add_argument("--lmcache-python", default=os.environ.get("KVTIER_LMCACHE_PYTHON", ".venv-lmcache/bin/python"),
                    help="the interpreter LMCache is installed in (scripts/lmcache-venv.sh; env KVTIER_LMCACHE_PYTHON)")
    ap.add_argument("--lmcache-odirect", action="store_true", help="LMCache's use_odirect (off by default there)")
    args = ap.parse_args()
    stop_children_on_signal()  # a SIGTERM unwinds main's finally: LMCache's side is told to quit, files removed
    if args.tokens % args.chunk_size:
        raise SystemExit("--tokens must be a multiple of --chunk-size")
    base = Path(tempfile.mkdtemp(prefix="kvtier-alternatives-", dir=args.dir))
    kv = make_kv(args.tokens, LAYERS, HEADS, HEAD_DIM, SEED)
    sides: dict = {}
    try:
        sides["lmcache"] = LMCacheSide(args.lmcache_python, args, base)
        if sides["lmcache"].hello["kv_sha256"] != kv_digest(kv):
            raise SystemExit("LMCache's side built a different KV (another torch version?): nothing compared")
        sides["kvtier"] = KVTierSide(kv, args, base)
        runs = run_rounds(sides, args.rounds, args.tokens)
    finally:
        for side in sides.values():
            side.close()
        shutil.rmtree(base, ignore_errors=True)
    figures = summarise(runs, kv.numel() * kv.element_size())
    report(figures)
    hello = sides["lmcache"].hello
    page_cache = runs[("kvtier", "disk")][0]["page_cache"]
    result({"tokens": args.tokens, "kv_mib": kv.numel() * kv.element_size() / 2**20, "rounds": args.rounds,
            "lmcache": hello["lmcache"], "lmcache_torch": hello["torch"], "page_cache": page_cache,
            "lmcache_odirect": args.lmcache_odirect} | figures)


if __name__ == "__main__":
    main()
