"""kvtier route's scoring in `kvtier sim`: 4 replicas on the Mooncake synthetic trace, policies side by side.

Replays the trace (``../shared/workloads/mooncake_synthetic_trace.jsonl``; each 512-token block one chunk)
through simulated fleets of real KVCaches whose router is ``kvtier.fleet.scoring``, the module `kvtier route`
decides with:

* the peer measured in the same run: one cache holding all the fleet's chunks (``--capacity``, 10,000);
* 4 replicas holding a quarter each, routed by round-robin, sticky sessions alone (round-robin for a
  session's first request), pure prefix affinity, and prefix affinity under the load bound (with and
  without sticky sessions), and prefix affinity under looser bounds (``--looser``), to show what the bound
  costs in hits and buys in balance.

The trace names no sessions, so a request continues the session of the latest earlier request whose prompt
(its full blocks) its own prompt extends: a conversation's next turn. Reports each fleet's chunk hit ratio,
its ratio to the one cache's, and the load balance as max/mean over replicas of the requests served and of
the prefill tokens computed. Target: load-bounded affinity within 5% of the one cache's hit ratio at
max/mean load <= 1.25 (``met``: at ``--epsilon``, kvtier route's default; ``met_at_epsilon``: the smallest
epsilon run that meets it). Last line: RESULT {json}.

    PYTHONPATH=. python benchmarks/route_sim.py [--limit 2000] [--epsilon 0.25] [--looser 0.5,1,2]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import result  # noqa: E402

from kvtier.apps.sim.fleet import FleetConfig, SimTier  # noqa: E402
from kvtier.apps.sim.replay import SimResult, replay  # noqa: E402
from kvtier.apps.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest, read_mooncake  # noqa: E402
from kvtier.fleet.scoring import Routing, RoutingConfig  # noqa: E402
from kvtier.fleet.workloads import find_workload_file  # noqa: E402

TARGET_HIT_VS_ONE_CACHE = 0.95
TARGET_MAX_OVER_MEAN = 1.25


def with_sessions(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Each request continues the session of the latest earlier one whose full blocks its prompt starts with."""
    ends: dict[tuple[int, int], str] = {}  # (position, block id of a prompt's last full block) -> session
    out = []
    for n, request in enumerate(requests):
        blocks = request.prompt.blocks
        full = len(blocks) if request.input_tokens % TRACE_BLOCK_TOKENS == 0 else len(blocks) - 1
        session = next((ends[(i, blocks[i])] for i in range(full - 1, -1, -1) if (i, blocks[i]) in ends), f"s{n}")
        if full:
            ends[(full - 1, blocks[full - 1])] = session
        out.append(dataclasses.replace(request, session=session))
    return out


def balance(result: SimResult) -> dict[str, float]:
    requests = [r.requests for r in result.replicas]
    prefill = [r.prefill_tokens for r in result.replicas]
    return {"requests": max(requests) / (sum(requests) / len(requests)),
            "prefill_tokens": max(prefill) / (sum(prefill) / len(prefill))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", help="Mooncake-format trace (default: the shared synthetic trace)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--capacity", type=int, default=10_000, help="chunks of the whole fleet")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--epsilon", type=float, default=0.25)
    p.add_argument("--looser", default="0.5,1,2", help="more load-bound epsilons to compare (comma-separated)")
    args = p.parse_args()

    trace = find_workload_file("mooncake_synthetic_trace.jsonl", args.trace)
    requests = with_sessions(read_mooncake(trace, limit=args.limit))
    bounded = RoutingConfig(Routing.LOAD_BOUNDED, epsilon=args.epsilon)
    fleets = {
        "one cache": (1, RoutingConfig(Routing.ROUND_ROBIN)),
        "round-robin": (args.replicas, RoutingConfig(Routing.ROUND_ROBIN)),
        "sticky only": (args.replicas, RoutingConfig(Routing.ROUND_ROBIN, sticky=True)),
        "prefix affinity": (args.replicas, RoutingConfig(Routing.PREFIX)),
        "load-bounded": (args.replicas, bounded),
        "load-bounded + sticky": (args.replicas, dataclasses.replace(bounded, sticky=True)),
        **{f"load-bounded eps {eps:g}": (args.replicas, dataclasses.replace(bounded, epsilon=eps))
           for eps in sorted({float(e) for e in args.looser.split(",") if e.strip()} - {args.epsilon})},
    }
    results: dict[str, SimResult] = {}
    with tqdm(total=len(requests) * len(fleets), unit="req", desc="route_sim", mininterval=1.0) as bar:
        for label, (replicas, routing) in fleets.items():
            fleet = FleetConfig(replicas=replicas, tiers=(SimTier(chunks=args.capacity // replicas),), routing=routing)
            done = bar.n
            results[label] = replay(requests, fleet, TRACE_BLOCK_TOKENS, label=label,
                                    progress=lambda n, base=done: bar.update(base + n - bar.n))
    one = results["one cache"].chunk_hit_ratio
    print(f"{len(requests):,} requests, {args.replicas} replicas x {args.capacity // args.replicas:,} chunks "
          f"vs one cache of {args.capacity:,}")
    print(f"{'fleet':>22} {'chunk hits':>10} {'vs one':>7} {'max/mean requests':>18} {'max/mean prefill':>17}")
    figures: dict[str, float] = {"requests": len(requests), "one_cache_hit": one}
    for label, res in results.items():
        load = balance(res) if label != "one cache" else {"requests": 1.0, "prefill_tokens": 1.0}
        print(f"{label:>22} {res.chunk_hit_ratio:>10.3f} {res.chunk_hit_ratio / one:>7.3f} "
              f"{load['requests']:>18.2f} {load['prefill_tokens']:>17.2f}")
        key = label.replace(" + ", "_").replace(" ", "_").replace("-", "_")
        figures.update({f"{key}_hit": res.chunk_hit_ratio, f"{key}_vs_one": res.chunk_hit_ratio / one,
                        f"{key}_max_mean_requests": load["requests"],
                        f"{key}_max_mean_prefill": load["prefill_tokens"]})
    bounds = {args.epsilon: "load_bounded", **{float(k.rpartition(" ")[2]): k.replace(" ", "_").replace("-", "_")
                                                for k in fleets if k.startswith("load-bounded eps")}}
    meets = sorted(eps for eps, key in bounds.items() if figures[f"{key}_vs_one"] >= TARGET_HIT_VS_ONE_CACHE
                   and figures[f"{key}_max_mean_requests"] <= TARGET_MAX_OVER_MEAN)
    result({**figures, "epsilon": args.epsilon, "target_vs_one": TARGET_HIT_VS_ONE_CACHE,
            "target_max_mean": TARGET_MAX_OVER_MEAN, "met": args.epsilon in meets,
            "met_at_epsilon": meets[0] if meets else None})


if __name__ == "__main__":
    main()
