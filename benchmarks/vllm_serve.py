"""vLLM's real OpenAI server under concurrent traffic, driven by vLLM's own benchmark client: vLLM alone vs
vLLM + kvtier (issue 33, item 7).

Every server is ``kvtier vllm serve`` (vLLM's own ``vllm serve``) of SmolLM2-135M-Instruct (float32, blocks of
32 tokens, eager mode), with vLLM's prefix cache held to a quarter of the prefix workload's KV
(``--num-gpu-blocks-override``); the kvtier servers add ``KVTierConnector`` (chunks of 256 tokens) and differ
from vLLM alone in nothing else. The client is vLLM's benchmark client (``vllm bench serve``, run in this
process), greedy with fixed output lengths:

* **prefix**: ``prefix_repetition`` (full: 16 prefixes of 2,048 tokens + 64, 16 output tokens, 48 prompts;
  shuffled): vLLM alone and kvtier's memory tier at 1, 4 and 8 requests in flight; at 4, the disk tier and a
  real redis-server, with synchronous and asynchronous loads (``load_mode``, where the connector has it).
  kvtier is measured in steady state: the same prompts run once unmeasured, so the tiers hold the prefixes;
  then vLLM's prefix cache is reset (``/reset_prefix_cache``), the page cache dropped (disk), and the
  measured run follows. vLLM alone's cache is reset before each run the same way.
* **random**: ``random`` prompts (1,024 tokens, never repeated) at 4 in flight: what lookups and saves cost
  when nothing hits: vLLM alone and the memory tier in interleaved pairs on the same prompts (a new seed per
  pair), the order alternating; with the CPU seconds per request of the server and of kvtier's own threads.
* **ITL while loading**: on each disk-tier server, streams decode while prompts whose 4,096-token prefix the
  disk tier holds (page cache dropped) arrive one by one: the streams' ITL p99 while a load runs vs with none.

Reported per run: request throughput, TTFT p50/p99, ITL p50/p99, the share of prompt tokens loaded from kvtier
(``vllm:kvtier_hit_tokens_total`` on the server's /metrics over the client's prompt tokens) and the load
average; a table, ``results/vllm_serve/vllm_serve.png`` and ``.json``, and ``RESULT {json}`` with the ratios
against vLLM alone in the same run and each target of issue 33 (pass / fail).

    python benchmarks/vllm_serve.py [--quick] [--out results/vllm_serve]
    (parts alone: --itl-only sync,async,async-nice [--itl-loads N]; --scaling 8,4,8,4; --redis-only; --random-only)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from _util import evict_page_cache, result, stop_children_on_signal  # noqa: E402
from _vllm_serve_client import (  # noqa: E402
    cpu_delta,
    dataset_args,
    itl_under_load,
    omp_binding,
    server_counter,
    server_cpu,
    summarize,
    vllm_bench,
)
from _vllm_serve_report import plot, print_table, targets  # noqa: E402

from kvtier.net.ports import free_port  # noqa: E402
from harness.vllm_server import VllmServer  # noqa: E402

NAME, BLOCK, CHUNK, VOCAB = "smollm2", 32, 256, 49152
FULL = dict(prefixes=12, prefix_len=2048, suffix_len=64, output_len=16, prompts=36, concurrency=(1, 4, 8),
            random_len=1024, random_prompts=16, random_reps=4, itl_prefix=4096, itl_loads=3, streams=3,
            stream_tokens=600)
#: the full run's prefix sizes and ITL probe with fewer prompts (12: one per prefix) and 4 pairs of random runs:
#: every row of the full run in about 30 minutes on 2 cores
MEDIUM = dict(prefixes=12, prefix_len=2048, suffix_len=64, output_len=16, prompts=16, concurrency=(1, 4, 8),
              random_len=1024, random_prompts=8, random_reps=4, itl_prefix=4096, itl_loads=3, streams=3,
              stream_tokens=300)
#: every server's environment. ``VLLM_CPU_NUM_OF_RESERVED_CPU``: vLLM's CPU build keeps cores out of the forward
#: pass's OpenMP threads for its scheduler process: one without a KV connector, one more with any
#: ``--kv-transfer-config`` (it assumes a P/D transfer connector). On 2 cores vLLM alone then ran 1 OpenMP thread
#: and every kvtier server 2 (2 reserved >= 2 cores: vLLM reserves none), which made kvtier look up to 1.9x faster
#: on prompts that never hit. Fixing it at 1 gives every arm the same binding: 1 core for the forward pass.
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
#: the arms of ``--itl-only`` and ``--redis-only``: one server each, with these connector settings added
ITL_ARMS = {"sync": {"load_mode": "sync"}, "async": {"load_mode": "async", "load_nice": 0},
            "async-nice": {"load_mode": "async", "load_nice": 19}}
QUICK = dict(prefixes=8, prefix_len=512, suffix_len=32, output_len=8, prompts=16, concurrency=(4,),
             random_len=512, random_prompts=8, random_reps=1, itl_prefix=512, itl_loads=1, streams=2,
             stream_tokens=100)


class Bench:
    def __init__(self, size: dict, out: Path, work: Path) -> None:
        from kvtier.integrations.models import ensure_smollm2

        self.size, self.out, self.work = size, out, work
        self.model = str(ensure_smollm2())
        self.log = out / "client.log"
        self.log.write_text("")
        working_set = size["prefixes"] * (size["prefix_len"] + size["suffix_len"])
        self.blocks = -(-working_set // BLOCK // 4)  # a quarter of the prefix workload's KV
        itl_need = -(-(size["itl_prefix"] + 16) // BLOCK) + size["streams"] * -(-(64 + size["stream_tokens"]) // BLOCK)
        if itl_need > self.blocks:
            raise SystemExit(f"{self.blocks} blocks cannot hold the ITL probe's {itl_need}")
        self.max_len = max(size["itl_prefix"] + 64, size["prefix_len"] + size["suffix_len"] + 64,
                           size["random_len"] + 64)
        self.rows: list[dict] = []
        self.itl: dict[str, dict] = {}
        self.notes: list[str] = []

    def server(self, label: str, tiers: list[dict] | None, mode: str | dict | None) -> VllmServer:
        """``mode``: the connector's ``load_mode``, or a dict of settings (``ITL_ARMS``)."""
        kvtier = None
        if tiers is not None:
            extra = mode if isinstance(mode, dict) else {"load_mode": mode} if mode else {}
            kvtier = {"chunk_size": CHUNK, "tiers": tiers, **extra}
        args = ("--served-model-name", NAME, "--block-size", str(BLOCK), "--max-model-len", str(self.max_len),
                "--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-num-seqs", "16",
                "--num-gpu-blocks-override", str(self.blocks))
        log = self.out / f"server-{label.replace(' ', '-')}.log"
        return VllmServer(self.model, free_port(), log, kvtier=kvtier, args=args,
                          env=SERVER_ENV)

    def dataset(self, workload: str) -> list[str]:
        return dataset_args(workload, self.size)

    def settle(self, server: VllmServer, disk: Path | None) -> None:
        """After a run: wait for kvtier's saves (they hold vLLM's blocks until copied; the disk tier then writes
        in the background), empty vLLM's prefix cache and, for the disk tier, the page cache."""
        server.reset_prefix_cache()
        if server.kvtier is not None:
            time.sleep(3.0)
            server.reset_prefix_cache()
        if disk is not None:
            method = evict_page_cache(disk)
            note = {"drop_caches": "disk tier: page cache dropped (/proc/sys/vm/drop_caches) before each measured "
                                   "run and before the ITL probe's loads",
                    "fadvise": "disk tier: the tier's files evicted from the page cache (posix_fadvise DONTNEED; "
                               "drop_caches needs root) before each measured run and the ITL probe's loads"}[method]
            if note not in self.notes:
                self.notes.append(note)

    def run(self, server: VllmServer, label: str, workload: str, concurrency: int, seed: int,
            disk: Path | None = None) -> dict:
        self.settle(server, disk)
        hits, preempted = _hits(server), server_counter(server.url, "vllm:num_preemptions_total")
        load, cpu = os.getloadavg()[0], server_cpu(server.proc.pid)
        raw = vllm_bench(server.url, NAME, self.model, self.dataset(workload), concurrency, seed, self.log)
        time.sleep(1.0)  # the last step's kvtier counters reach /metrics with its output
        row = {"workload": workload, "label": label, "concurrency": concurrency, "seed": seed, **summarize(raw),
               "loadavg": (load + os.getloadavg()[0]) / 2, "duration_s": raw["duration"]}
        row["loaded_share"] = (_hits(server) - hits) / row["prompt_tokens"]
        # vLLM's own counter: scheduling under a small cache
        row["preemptions"] = server_counter(server.url, "vllm:num_preemptions_total") - preempted
        row.update(cpu_delta(cpu, server_cpu(server.proc.pid), row["requests"]))  # all, kvtier's, by thread
        row["_texts"] = raw["generated_texts"]  # compared with vLLM alone's at the end, then dropped
        self.rows.append(row)
        return row

    def warm(self, server: VllmServer) -> None:
        """The prefix workload once, unmeasured: the tiers hold its prefixes afterwards (steady state)."""
        vllm_bench(server.url, NAME, self.model, self.dataset("prefix"), 4, 0, self.log)

    def itl_probe(self, server: VllmServer, mode: str, disk: Path) -> None:
        s, rng = self.size, random.Random(7)
        loads = [[rng.randrange(100, VOCAB - 100) for _ in range(s["itl_prefix"] + 16)] for _ in range(s["itl_loads"])]
        streams = [[rng.randrange(100, VOCAB - 100) for _ in range(64)] for _ in range(s["streams"])]
        for prompt in loads:  # kvtier stores each prefix; then the page cache is dropped
            server.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 1}, timeout=600)
        self.settle(server, disk)
        before = _hits(server)
        m = itl_under_load(server.url, NAME, loads, streams, max_tokens=s["stream_tokens"], quiet_s=3.0, gap_s=1.5)
        time.sleep(1.0)
        m["prefix_tokens"] = s["itl_prefix"]
        m["loaded_tokens"] = _hits(server) - before
        self.itl[mode] = m


def _hits(server: VllmServer) -> float:
    return server_counter(server.url, "vllm:kvtier_hit_tokens_total") if server.kvtier is not None else 0.0


def _start(stack: ExitStack, *servers: VllmServer, notes: list[str] | None = None) -> None:
    for server in servers:
        stack.callback(server.stop)
        server.launch()
    for server in servers:
        server.wait_ready()
        if notes is not None:  # every arm's forward pass on the same cores (SERVER_ENV)
            notes.append(f"{server.log.stem}: {omp_binding(server.proc.pid)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few-minute smoke run: smaller workloads, 4 in flight")
    parser.add_argument("--out", default="results/vllm_serve")
    parser.add_argument("--alone-at", default="4", help="requests in flight at which vLLM alone runs (comma-separated; "
                        "it is compute-bound here, so 4 alone keeps a full run near 30 minutes); the ratios of the "
                        "memory tier at other levels are against the nearest one run")
    parser.add_argument("--medium", action="store_true",
                        help="the full run's prefix sizes and ITL probe, fewer prompts and random runs (~30 min)")
    parser.add_argument("--no-redis", action="store_true", help="leave out the Redis rows")
    parser.add_argument("--itl-prefix", type=int, metavar="TOKENS",
                        help="prefix length of the ITL-while-loading probe (the full run's 4,096 in a --quick run)")
    parser.add_argument("--itl-only", metavar="ARMS", help="only the ITL-while-loading probe, on one disk-tier "
                        f"server per arm (comma-separated, of {', '.join(ITL_ARMS)})")
    parser.add_argument("--itl-loads", type=int, metavar="N", help="prefixes the ITL probe loads (each followed by "
                        "its control request)")
    parser.add_argument("--scaling", metavar="C1,C2", help="only the memory tier (asynchronous loads) on the prefix "
                        "workload at these numbers of requests in flight, with vLLM's preemptions per run")
    parser.add_argument("--redis-only", nargs="?", const="sync,async", metavar="ARMS", help="only the Redis tier (a "
                        "real redis-server), one server per arm (default sync,async), at 4 in flight")
    parser.add_argument("--random-only", action="store_true", help="only the random prompts: vLLM alone and the "
                        "memory tier in interleaved pairs")
    parser.add_argument("--report", metavar="JSON", help="print the table, PNG and RESULT of a saved run again")
    args = parser.parse_args()
    stop_children_on_signal()
    if args.report:
        run = json.loads(Path(args.report).read_text())
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report(run, out)
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from harness.redis_server import RedisServer, have_redis_server

    size = dict(QUICK if args.quick else MEDIUM if args.medium else FULL)
    if args.itl_prefix:
        size["itl_prefix"] = args.itl_prefix
    if args.itl_loads:
        size["itl_loads"] = args.itl_loads
        size["stream_tokens"] = max(size["stream_tokens"], 150 + 80 * args.itl_loads)  # streams outlast the loads
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.itl_only:
        itl_only(size, out, args.itl_only.split(","))
        return
    if args.scaling or args.redis_only or args.random_only:
        tier_rows(size, out, "redis" if args.redis_only else "random" if args.random_only else "memory",
                  [int(c) for c in args.scaling.split(",")] if args.scaling else [4],
                  args.redis_only.split(",") if args.redis_only else [])
        return
    modes = ["sync", "async"]
    memory = [{"kind": "memory", "capacity_bytes": "4GiB"}]
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-serve-") as tmp:
        bench = Bench(size, out, Path(tmp))
        alone_at = sorted({int(c) for c in args.alone_at.split(",")} & set(size["concurrency"])) or [4]
        steps = len(size["concurrency"]) + len(alone_at) + 2 * size["random_reps"] + 4 * len(modes)
        with Progress(TextColumn("{task.description:<44}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn()) as progress, ExitStack() as phase:
            task = progress.add_task("starting vLLM alone and vLLM + kvtier memory", total=steps)

            def step(text: str) -> None:
                progress.update(task, description=text)

            alone, mem = bench.server("alone", None, None), bench.server("memory", memory, None)
            _start(phase, alone, mem, notes=bench.notes)
            step("warming kvtier memory")
            bench.warm(mem)
            for c in size["concurrency"]:
                for server, label in ((alone, "vLLM alone"), (mem, "kvtier memory")):
                    if server is alone and c not in alone_at:
                        continue
                    step(f"prefix, {c} in flight: {label}")
                    bench.run(server, label, "prefix", c, seed=0)
                    progress.advance(task)
            for rep in range(size["random_reps"]):  # interleaved pairs, the order alternating
                pair = ((alone, "vLLM alone"), (mem, "kvtier memory"))
                for server, label in pair[::-1] if rep % 2 else pair:
                    step(f"random prompts, rep {rep + 1}: {label}")
                    bench.run(server, label, "random", 4, seed=100 + rep)
                    progress.advance(task)
            phase.close()

            disk_dir = {mode: bench.work / f"disk-{mode}" for mode in modes}
            servers = {mode: bench.server(f"disk {mode}", [{"kind": "disk", "path": str(disk_dir[mode]),
                                                             "capacity_bytes": "16GiB", "write_queue_depth": 64}],
                                          mode) for mode in modes}
            step("starting kvtier disk servers")
            _start(phase, *servers.values(), notes=bench.notes)
            for mode, server in servers.items():
                step(f"disk {mode}: warming")
                bench.warm(server)
                step(f"disk {mode}: prefix, 4 in flight")
                bench.run(server, f"kvtier disk {mode}", "prefix", 4, seed=0, disk=disk_dir[mode])
                progress.advance(task)
                step(f"disk {mode}: ITL while loading")
                bench.itl_probe(server, mode, disk_dir[mode])
                progress.advance(task)
            phase.close()

            if have_redis_server() and not args.no_redis:
                redis = RedisServer(maxmemory="6gb").start()
                phase.callback(redis.stop)
                servers = {mode: bench.server(f"redis {mode}", [{"kind": "redis", "url": redis.url, "timeout_s": 30.0,
                                                                  "key_prefix": f"bench-{mode}:"}],
                                              mode) for mode in modes}
                step("starting kvtier redis servers")
                _start(phase, *servers.values(), notes=bench.notes)
                for mode, server in servers.items():
                    step(f"redis {mode}: warming")
                    bench.warm(server)
                    progress.advance(task)
                    step(f"redis {mode}: prefix, 4 in flight")
                    bench.run(server, f"kvtier redis {mode}", "prefix", 4, seed=0)
                    progress.advance(task)
                phase.close()
            else:
                bench.notes.append("Redis rows skipped (--no-redis, or no redis-server)")
            step("done")

    rows = compare(bench.rows)
    bench.notes.append(f"vLLM's prefix cache: {bench.blocks} blocks of {BLOCK} tokens (a quarter of the prefix "
                       f"workload); load average {os.getloadavg()[0]:.1f} at the end; {os.cpu_count()} CPUs")
    report({"quick": args.quick, "size": size, "load_modes": modes, "rows": rows, "itl": bench.itl,
            "notes": bench.notes, "loadavg_end": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M")}, out)


def itl_only(size: dict, out: Path, arms: list[str]) -> None:
    """The ITL probe alone, one disk-tier server per arm, in the order given (all started first)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-itl-") as tmp, ExitStack() as stack:
        bench = Bench(size, out, Path(tmp))
        disks = {arm: bench.work / f"disk-{arm}" for arm in arms}
        servers = {arm: bench.server(f"itl {arm}", [{"kind": "disk", "path": str(disks[arm]),
                                                      "capacity_bytes": "16GiB", "write_queue_depth": 64}],
                                     ITL_ARMS[arm]) for arm in arms}
        _start(stack, *servers.values(), notes=bench.notes)
        for arm, server in servers.items():
            load = os.getloadavg()[0]
            bench.itl_probe(server, arm, disks[arm])
            bench.itl[arm]["loadavg"] = (load + os.getloadavg()[0]) / 2
            print(arm, json.dumps(bench.itl[arm]), flush=True)
    report({"quick": False, "size": size, "load_modes": arms, "rows": [], "itl": bench.itl, "notes": bench.notes,
            "loadavg_end": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M")}, out)


def tier_rows(size: dict, out: Path, tier: str, levels: list[int], arms: list[str]) -> None:
    """The prefix workload on one tier, no vLLM alone: the memory tier (asynchronous loads), or Redis with sync and
    async loads (one server each over one redis-server), warmed once, then at each level of requests in flight in
    order. ``random``: vLLM alone and the memory tier on random prompts, interleaved pairs, alternating order."""
    from harness.redis_server import RedisServer

    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-tier-") as tmp, ExitStack() as stack:
        bench = Bench(size, out, Path(tmp))
        if tier == "random":
            servers = {"vLLM alone": bench.server("alone", None, None),
                       "kvtier memory": bench.server("memory", [{"kind": "memory", "capacity_bytes": "4GiB"}], None)}
            _start(stack, *servers.values(), notes=bench.notes)
            pairs = list(servers.items())
            for rep in range(size["random_reps"]):
                for label, server in pairs[::-1] if rep % 2 else pairs:
                    row = bench.run(server, label, "random", 4, seed=100 + rep)
                    print(json.dumps({k: v for k, v in row.items() if not k.startswith("_")}), flush=True)
            servers = {}
        elif tier == "memory":
            servers = {"async": bench.server("memory", [{"kind": "memory", "capacity_bytes": "4GiB"}], None)}
        else:
            redis = RedisServer(maxmemory="6gb").start()
            stack.callback(redis.stop)
            servers = {mode: bench.server(f"redis {mode}", [{"kind": "redis", "url": redis.url, "timeout_s": 30.0,
                                                              "key_prefix": f"bench-{mode}:"}], ITL_ARMS[mode])
                       for mode in arms}
        _start(stack, *servers.values(), notes=bench.notes)
        for mode, server in servers.items():
            bench.warm(server)
            for c in levels:
                row = bench.run(server, "kvtier memory" if tier == "memory" else f"kvtier redis {mode}", "prefix", c,
                                seed=0)
                print(json.dumps({k: v for k, v in row.items() if not k.startswith("_")}), flush=True)
    report({"quick": False, "size": size, "load_modes": list(servers), "rows": compare(bench.rows), "itl": {},
            "notes": bench.notes, "loadavg_end": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M")}, out)


def compare(rows: list[dict]) -> list[dict]:
    """Each kvtier run against vLLM alone on the same prompts (same workload and seed): greedy outputs equal,
    and request throughput (vLLM alone at the nearest concurrency run)."""
    for row in rows:
        bases = [r for r in rows if r["label"] == "vLLM alone" and r["workload"] == row["workload"]
                 and r["seed"] == row["seed"]]
        base = min(bases, key=lambda r: abs(r["concurrency"] - row["concurrency"]), default=None)
        if base is not None and row["label"] != "vLLM alone":
            row["vs_alone"] = row["req_s"] / base["req_s"]
            row["vs_alone_at"] = base["concurrency"]
            row["same_outputs"] = row["_texts"] == base["_texts"]
    for row in rows:
        row.pop("_texts", None)
    return rows


def report(run: dict, out: Path) -> None:
    """The table, the PNG, the JSON and the RESULT line of a run (``--report`` re-renders a saved one)."""
    rows, itl = run["rows"], run["itl"]
    default_mode = "async" if "async" in run["load_modes"] else "sync"
    print_table(rows, itl, run["notes"])
    plot(rows, itl, out / "vllm_serve.png")
    ratios, checks = targets(rows, itl, default_mode)
    (out / "vllm_serve.json").write_text(json.dumps({**run, "ratios": ratios, "targets": checks}, indent=1))
    print(f"plot: {out / 'vllm_serve.png'}   raw: {out / 'vllm_serve.json'}   client log: {out / 'client.log'}")
    result({"benchmark": "vllm_serve", "quick": run["quick"], "load_modes": run["load_modes"],
            "default_load_mode": default_mode, **{k: round(v, 3) for k, v in ratios.items()}, "targets": checks,
            "loadavg_1m_end": round(run["loadavg_end"], 2)})

if __name__ == "__main__":
    main()
