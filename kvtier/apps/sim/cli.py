"""``kvtier sim``: replay a trace through a simulated fleet of kvtier caches and report what it would hit.

    kvtier sim ../shared/workloads/mooncake_synthetic_trace.jsonl                   # one cache, 10,000 chunks
    kvtier sim TRACE --capacities 1000,3000,10000 --policies lru,s3fifo,arc,arc-lfu  # a sweep, plotted
    kvtier sim TRACE --replicas 4 --routing load-bounded --capacity 10000            # 4 x 2,500 chunks
    kvtier sim results/bench/multiround.json --chunk-tokens 64 --replicas 2 --sticky # a kvtier bench run
    kvtier sim TRACE --fleet fleet.yaml                                              # tiers, shared tier ...
    kvtier sim arm-a.json --fleet fleet.yaml --background arm-b.json                 # runs side by side

TRACE is a Mooncake-format JSONL trace (each 512-token block id becomes ``--block-tokens`` token ids, so one
block is one chunk) or a ``kvtier bench`` result JSON (its prompts are rebuilt by the bench's workload code).
Every replica is a real KVCache over real memory tiers and eviction policies with a tiny KV spec; the router
is kvtier.fleet.scoring. Reports chunk and token hit ratios (overall and per tier), per-replica requests and
prefill tokens, prefill saved, against LRU, the offline optimum (Belady) and an infinite cache: a table, a
JSON and a PNG (hit ratio against capacity, one line per policy) under --out.

Flags override the fleet file: --capacity/--capacities and --policy/--policies set the first tier of every
replica (capacity: chunks of all replicas together).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kvtier.base.errors import ConfigError


def add_parser(subparsers) -> argparse.ArgumentParser:
    from kvtier.apps.sim import fleet

    p = subparsers.add_parser("sim", help="replay a trace through a simulated fleet of kvtier caches",
                              description=__doc__ + "\nFleet file (--fleet, YAML):\n" + fleet.__doc__.split(
                                  "YAML (every key optional)::", 1)[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="Mooncake-format JSONL trace, or a kvtier bench result JSON")
    f = p.add_argument_group("fleet")
    f.add_argument("--fleet", help="fleet YAML (see above); flags below override it")
    f.add_argument("--replicas", type=int)
    f.add_argument("--routing", choices=["round-robin", "random", "prefix", "load-bounded"])
    f.add_argument("--epsilon", type=float, help="load-bounded routing's slack (default 0.25)")
    f.add_argument("--sticky", action="store_true", help="keep each session on one replica")
    f.add_argument("--capacity", type=int, help="first tier: chunks of all replicas together")
    f.add_argument("--policy", help="first tier's eviction policy")
    s = p.add_argument_group("sweep (one replay per capacity and policy)")
    s.add_argument("--capacities", help="comma-separated chunk counts, e.g. 1000,3000,10000")
    s.add_argument("--policies", help="comma-separated policies, e.g. lru,s3fifo,arc,arc-lfu,tinylfu")
    s.add_argument("--no-belady", action="store_true", help="skip the offline optimum")
    t = p.add_argument_group("trace")
    t.add_argument("--limit", type=int, help="replay only the first N requests")
    t.add_argument("--block-tokens", type=int, default=512,
                   help="Mooncake: token ids per block, i.e. per chunk (default 512, the trace's own)")
    t.add_argument("--cut-tail", action="store_true",
                   help="Mooncake: cut prompts to input_length, so partial last blocks are never stored")
    t.add_argument("--chunk-tokens", type=int, default=64, help="bench JSON: tokens per chunk (default 64)")
    t.add_argument("--target", help="bench JSON: the target (label) whose run to replay (default: the first)")
    t.add_argument("--tokenizer", metavar="MODEL_DIR",
                   help="bench JSON: chat prompts become this model's token ids (its tokenizer and chat template, "
                        "as the server computes them), so chunks and vLLM blocks fall where the server's did "
                        "(default: word-level ids)")
    t.add_argument("--background", nargs="+", metavar="BENCH_JSON", default=[],
                   help="bench JSON: other runs that shared the replicas at the time (the replayed run itself left "
                        "out); each request is placed where it ran (the fleet's replica_names) and holds room "
                        "in that replica's device cache and tiers until its measured end")
    p.add_argument("--out", default="results/sim", help="folder for sim.json and sim.png")
    p.set_defaults(func=run)
    return p


def _csv(text: str | None, cast) -> list | None:
    return None if text is None else [cast(x) for x in text.split(",") if x.strip()]


def load_fleet(args: argparse.Namespace):
    """The fleet file (or the default fleet) with the command line's overrides."""
    from kvtier.apps.sim.fleet import FleetConfig
    from kvtier.apps.sim.study import with_first_tier
    from kvtier.fleet.scoring import Routing

    fleet = FleetConfig.from_yaml(args.fleet) if args.fleet else FleetConfig()
    routing = fleet.routing
    if args.routing:
        routing = dataclasses.replace(routing, routing=Routing(args.routing))
    if args.epsilon is not None:
        routing = dataclasses.replace(routing, epsilon=args.epsilon)
    if args.sticky:
        routing = dataclasses.replace(routing, sticky=True)
    fleet = dataclasses.replace(fleet, routing=routing,
                                replicas=fleet.replicas if args.replicas is None else args.replicas)
    return with_first_tier(fleet, args.capacity, args.policy)


def load_requests(args: argparse.Namespace, tokenizer=None):
    from kvtier.apps.sim.trace import is_mooncake, read_mooncake

    if is_mooncake(args.trace):
        return read_mooncake(args.trace, block_tokens=args.block_tokens, cut_tail=args.cut_tail, limit=args.limit), \
            args.block_tokens
    from kvtier.apps.sim.bench_replay import read_bench_json

    return read_bench_json(args.trace, chunk_tokens=args.chunk_tokens, target=args.target, limit=args.limit,
                           tokenizer=tokenizer), args.chunk_tokens


def chat_tokenizer(args: argparse.Namespace):
    """--tokenizer's chat tokenizer (kvtier.integrations.prompts; needs transformers), or None."""
    if not args.tokenizer:
        return None
    from kvtier.integrations.prompts import PromptTokenizer

    return PromptTokenizer(args.tokenizer).chat


def load_background(args: argparse.Namespace, tokenizer=None) -> list:
    """The --background runs' requests (the replayed run itself left out)."""
    from kvtier.apps.sim.bench_replay import read_background

    return read_background(args.background, chunk_tokens=args.chunk_tokens, but=(args.trace, args.target),
                           tokenizer=tokenizer)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.apps.sim import report
    from kvtier.apps.sim.study import run_study

    try:
        fleet = load_fleet(args)
        tokenizer = chat_tokenizer(args)
        requests, chunk_tokens = load_requests(args, tokenizer)
        background = load_background(args, tokenizer) if args.background else []
        capacities = _csv(args.capacities, int) or [None]
        policies = _csv(args.policies, str) or [None]
        if any(p is not None and p != "lru" for p in policies) and "lru" not in policies:
            policies = ["lru", *policies]  # every table row is compared with LRU
        with tqdm(total=len(requests) * len(capacities) * len(policies), unit="req", desc="kvtier sim",
                  mininterval=1.0) as bar:
            study = run_study(requests, fleet, chunk_tokens, capacities=capacities, policies=policies,
                              belady=not args.no_belady, progress=lambda n: bar.update(n - bar.n),
                              background=background)
    except ConfigError as exc:
        print(f"kvtier sim: {exc}", file=sys.stderr)
        return 2
    title = f"kvtier sim: {Path(args.trace).name}, {len(requests):,} requests, " + (
        f"{fleet.replicas} replicas, routing {fleet.routing.routing.value}" if fleet.replicas > 1 else "one cache")
    report.print_study(study, title)
    out = Path(args.out)
    config = {"trace": str(args.trace), "requests": len(requests), "chunk_tokens": chunk_tokens,
              "fleet": dataclasses.asdict(fleet)}
    report.write_json(study, out / "sim.json", config)
    report.plot(study, out / "sim.png", title)
    print(f"results: {out / 'sim.json'}   plot: {out / 'sim.png'}")
    return 0
