"""A fleet for real: 3 `kvtier serve` replicas behind `kvtier route`, one multi-user multi-round chat per policy.

Starts the replicas (SmolLM2-135M-Instruct, one torch thread each: the machine is shared) and, per policy, a
router in front of them, then drives the same workload (`kvtier bench`'s multi-round generator: users share a
system prompt, each user's history grows round by round; every request names its user as its session)
through it:

* round-robin: ignores caches and sessions;
* sticky: round-robin for a session's first request, then back to the replica that served it;
* cache-aware: kvtier route's default, prefix affinity from the replicas' cache events under the load bound,
  with sticky sessions.

The three routers run side by side in front of the same replicas, and the workload's requests take turns
between them (``kvtier bench --interleave``; ``--concurrency`` requests in flight in all, 1 by default), so the
load other jobs put on this shared machine falls on every policy alike. Each policy runs under its own API
key, so its tenant salt gives it a cold cache of its own on every replica. The peer measured in the same run,
also taking turns, is one replica alone serving the same workload (its cached share of prompt tokens is what
a fleet should keep). With 4 users on 3 replicas round-robin moves every user every round.

Prints TTFT p50/p90 (client-measured), the cached share of prompt tokens and the requests each replica served,
per policy; writes JSON and a PNG under --out. Targets: cache-aware TTFT p50 at least 2x better than
round-robin, with a cached share at least 0.9 of one replica's. Last line: RESULT {json}.

    PYTHONPATH=. python benchmarks/route_fleet.py [--users 4 --rounds 8] [--concurrency 1] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

from _util import routed_per_replica, router_process, stop_children_on_signal

from kvtier.apps.bench import report
from kvtier.apps.bench.cli import bench
from kvtier.apps.bench.client import Target
from kvtier.apps.bench.launch import serve_processes
from kvtier.fleet.workloads import MultiRoundSpec
from kvtier.net.ports import free_port

POLICIES = {
    "round-robin": ["--policy", "round-robin", "--no-sticky"],
    "sticky": ["--policy", "round-robin", "--sticky"],
    "cache-aware": ["--policy", "load-bounded", "--sticky"],
}
TARGET_SPEEDUP = 2.0
TARGET_CACHED_SHARE = 0.9


@contextmanager
def router(replicas: list[Target], flags: list[str], model: str | None, log_dir: Path):
    """``kvtier route`` in front of ``replicas``; yields its URL once it answers, stops it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvtier", "route", "--port", str(port), "--log-level", "warning", *flags]
    for replica in replicas:
        cmd += ["--replica", replica.url]
    if model:
        cmd += ["--model", model]
    with router_process(cmd, f"http://127.0.0.1:{port}", log_dir / f"route-{flags[1]}-{port}.log") as url:
        yield url


def plot(runs: dict, summaries: dict, single: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, run in runs.items():
        series = report.ttft_by_round(run)
        left.plot(list(series), list(series.values()), marker="o", label=label)
    left.set(xlabel="round", ylabel="median TTFT (s), client-measured", yscale="log",
             title="TTFT per round through kvtier route (3 replicas)")
    left.grid(True, alpha=0.3)
    left.legend()
    labels = list(summaries)
    right.bar(labels, [summaries[k]["cached_share"] for k in labels], color=["#999", "#6a9", "#37c"])
    right.axhline(single["cached_share"], color="k", linestyle="--", label="one replica alone")
    right.set(ylabel="cached share of prompt tokens", title="prompt tokens served from kvtier", ylim=(0, 1))
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight, all policies together")
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--turn-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--model", help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--serve-args", default="--threads 1 --chunk-size 64 --memory-bytes 1GiB --max-queue 64",
                   help="extra kvtier serve arguments (one torch thread each: the machine is shared)")
    p.add_argument("--out", default="results/route_fleet")
    args = p.parse_args()
    stop_children_on_signal()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = MultiRoundSpec(args.users, args.rounds, args.system_words, args.turn_words, args.max_tokens,
                          sessions=True)
    serve_args = shlex.split(args.serve_args) + (["--model", args.model] if args.model else [])
    with serve_processes([(f"r{i}", serve_args) for i in range(args.replicas)], out) as replicas, \
            ExitStack() as routers:
        urls = {label: routers.enter_context(router(replicas, flags, args.model, out))
                for label, flags in POLICIES.items()}
        targets = [Target(label, url, f"route-fleet-{label}") for label, url in urls.items()]
        *fleet_runs, alone = bench([*targets, Target("one replica", replicas[0].url, "route-fleet-alone")],
                                   "multiround", spec, concurrency=args.concurrency, interleave=True)
        runs = dict(zip(urls, fleet_runs))
        served = {label: routed_per_replica(url) for label, url in urls.items()}
    report.print_tables([*runs.values(), alone])
    summaries = {label: report.summarize(run) for label, run in runs.items()}
    single = report.summarize(alone)
    for label, s in summaries.items():
        print(f"{label:>12}: TTFT p50 {s['ttft_p50_s']:.2f} s, p90 {s['ttft_p90_s']:.2f} s, cached share "
              f"{s['cached_share']:.3f}, requests per replica {sorted(served[label].values(), reverse=True)}")
    print(f"{'one replica':>12}: cached share {single['cached_share']:.3f}")
    report.write_json([*runs.values(), alone], out / "route_fleet.json",
                      {"spec": spec.__dict__, "serve_args": serve_args, "served": served})
    plot(runs, summaries, single, out / "route_fleet.png")
    aware, rr = summaries["cache-aware"], summaries["round-robin"]
    speedup = rr["ttft_p50_s"] / aware["ttft_p50_s"]
    share_vs_single = aware["cached_share"] / single["cached_share"] if single["cached_share"] else None
    failed = sum(s["failed"] + s["rejected_429"] for s in summaries.values())
    print(f"plot: {out / 'route_fleet.png'}   raw: {out / 'route_fleet.json'}")
    result = {
        "benchmark": "route_fleet", "replicas": args.replicas, "users": args.users, "rounds": args.rounds,
        "concurrency": args.concurrency,
        **{f"ttft_p50_s_{k}": round(s["ttft_p50_s"], 3) for k, s in summaries.items()},
        **{f"ttft_p90_s_{k}": round(s["ttft_p90_s"], 3) for k, s in summaries.items()},
        **{f"cached_share_{k}": round(s["cached_share"], 3) for k, s in summaries.items()},
        "cached_share_one_replica": round(single["cached_share"], 3),
        "requests_per_replica": {k: sorted(v.values(), reverse=True) for k, v in served.items()},
        "ttft_p50_speedup_vs_round_robin": round(speedup, 2),
        "cached_share_vs_one_replica": round(share_vs_single, 3) if share_vs_single is not None else None,
        "target_speedup": TARGET_SPEEDUP, "target_cached_share": TARGET_CACHED_SHARE,
        "met": speedup >= TARGET_SPEEDUP and (share_vs_single or 0) >= TARGET_CACHED_SHARE,
        "failed_requests": failed,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
