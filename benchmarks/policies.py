"""Eviction policies against LRU, Belady's offline optimum and an infinite cache, through ``kvtier sim``.

Every registered policy replays each workload at two sizes: one cache, and 4 replicas behind load-bounded
affinity routing (a quarter of the chunks each). Workloads, and their sizes in chunks of 512 tokens:

* ``mooncake`` (1k, 10k): the Mooncake synthetic trace (``../shared/workloads/``), every block a full
  chunk: the block-level model of the trace's reference figures (LRU 0.424 at 10k chunks);
* ``mooncake-cut`` (1k, 10k): the same prompts cut to their real length, so a partial last block is never
  stored, as a server would see them;
* ``chat`` (1k, 3k): kvtier.apps.sim.synthetic's chat / agent / RAG workload, another reuse shape generated here
  (its working set fits in 10k chunks, where every policy hits what an infinite cache does).

For each replay: chunk hit ratio, its ratio to LRU's and the share of the LRU-to-Belady gap it closes.
Where requests are routed, which replica gets a new prefix is a tie broken by hashing its first chunk key,
so the fleets are replayed ``--seeds`` times under differently named keys and the table gives the mean and
the range. Per policy, the cost of one operation (insert and evict, or access) on a recorded key stream
against LRU's.
Writes a PNG per workload under results/policies/ and ends with one line ``RESULT {json}``:
``{workload: {setup: {policy: {size: {"hit": .., "vs_lru": ..}}}}}`` plus the references and costs.

    python benchmarks/policies.py [--workloads mooncake,chat] [--block-tokens 512] [--out results/policies]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import result  # noqa: E402

from kvtier.apps.sim import report, synthetic  # noqa: E402
from kvtier.apps.sim.fleet import FleetConfig, SimTier  # noqa: E402
from kvtier.apps.sim.replica import SIM_MODEL  # noqa: E402
from kvtier.apps.sim.study import Study, chunk_chains, run_study  # noqa: E402
from kvtier.apps.sim.trace import read_mooncake  # noqa: E402
from kvtier.fleet.scoring import Routing, RoutingConfig  # noqa: E402
from kvtier.fleet.workloads import find_workload_file  # noqa: E402
from kvtier.policy import POLICIES, make_policy  # noqa: E402

SIZES = {"mooncake": (1_000, 10_000), "mooncake-cut": (1_000, 10_000), "chat": (1_000, 3_000)}
SETUPS = {"single": 1, "4 replicas": 4}


def workload(name: str, block_tokens: int, out: Path):
    if name == "chat":
        return read_mooncake(synthetic.write(out / "chat.jsonl"), block_tokens=block_tokens)
    trace = find_workload_file("mooncake_synthetic_trace.jsonl")
    return read_mooncake(trace, block_tokens=block_tokens, cut_tail=name == "mooncake-cut")


def op_cost_ns(requests, block_tokens: int, capacity: int = 1_000) -> dict[str, float]:
    """Nanoseconds per policy operation over the trace's key stream, as a tier of ``capacity`` issues them."""
    chains = chunk_chains(requests[:1500], block_tokens)
    out = {}
    for name in POLICIES:
        policy, held, ops = make_policy(name), set(), 0
        start = time.perf_counter()
        for keys in chains:
            for key in reversed(keys):  # tiers report a request's chunks deepest first
                ops += 1
                if key in held:
                    policy.on_access(key)
                    continue
                if len(held) >= capacity:
                    victim = policy.victim(lambda k: True)
                    held.discard(victim)
                    policy.on_remove(victim)
                held.add(key)
                policy.on_insert(key)
        out[name] = (time.perf_counter() - start) / ops * 1e9
    return out


def summarize(studies: list[Study], sizes: tuple[int, ...]) -> dict:
    """Per policy and size over the studies (one per key naming): mean hit ratio, its ratio to LRU's mean,
    the spread of the per-study ratios, and the share of the LRU-to-Belady gap closed."""
    first = studies[0]
    out: dict = {"ideal": first.ideal, "belady": {str(p.capacity): p.belady for p in first.points}}
    for policy in POLICIES:
        for size in sizes:
            points = [next(p for p in s.points if p.capacity == size and p.policy == policy) for s in studies]
            lru = [s.lru(size).result.chunk_hit_ratio for s in studies]
            hit = statistics.fmean(p.result.chunk_hit_ratio for p in points)
            ratios = [s.vs_lru(p) for s, p in zip(studies, points)]
            belady = points[0].belady
            out.setdefault(policy, {})[str(size)] = {
                "hit": hit, "vs_lru": hit / statistics.fmean(lru), "vs_lru_min": min(ratios),
                "vs_lru_max": max(ratios),
                "gap_closed": (hit - statistics.fmean(lru)) / (belady - statistics.fmean(lru)) if belady else None}
    return out


def print_table(name: str, setup: str, summary: dict, sizes: tuple[int, ...], seeds: int) -> None:
    spread = f"; over {seeds} namings of the keys, the range of the ratio in brackets" if seeds > 1 else ""
    print(f"\n{name}, {setup}: chunk hit ratio (vs LRU{spread}; share of the LRU-to-Belady gap closed)")
    print("| policy | " + " | ".join(f"{s:,} chunks" for s in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for policy in POLICIES:
        cells = []
        for size in sizes:
            f = summary[policy][str(size)]
            rng = f" [{f['vs_lru_min']:.3f}-{f['vs_lru_max']:.3f}]" if seeds > 1 else ""
            cells.append(f"{f['hit']:.3f} ({f['vs_lru']:.3f}x{rng}, {f['gap_closed']:.0%})")
        print(f"| {policy} | " + " | ".join(cells) + " |")
    print("| Belady (offline) | " + " | ".join(f"{summary['belady'][str(s)]:.3f}" for s in sizes) + " |")
    print("| infinite cache | " + " | ".join(f"{summary['ideal']:.3f}" for _ in sizes) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mooncake,mooncake-cut,chat")
    parser.add_argument("--block-tokens", type=int, default=512, help="token ids per trace block (= per chunk)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="replays of each fleet under differently named keys (routing ties fall differently)")
    parser.add_argument("--out", default="results/policies")
    args = parser.parse_args()
    out = Path(args.out)
    loaded = {name: workload(name, args.block_tokens, out) for name in args.workloads.split(",") if name}
    seeds = {setup: 1 if replicas == 1 else args.seeds for setup, replicas in SETUPS.items()}
    total = sum(len(requests) * len(SIZES[name]) for name, requests in loaded.items()) * len(POLICIES) \
        * sum(seeds.values())
    figures: dict = {}
    with tqdm(total=total, desc="replays", unit="req", mininterval=2.0) as bar:
        for name, requests in loaded.items():
            figures[name] = {"requests": len(requests)}
            for setup, replicas in SETUPS.items():
                fleet = FleetConfig(replicas=replicas, tiers=(SimTier(chunks=SIZES[name][0]),),
                                    routing=RoutingConfig(Routing.LOAD_BOUNDED))
                studies = []
                for seed in range(seeds[setup]):
                    base = bar.n
                    studies.append(run_study(
                        requests, fleet, args.block_tokens, capacities=SIZES[name], policies=list(POLICIES),
                        model=SIM_MODEL if seed == 0 else f"{SIM_MODEL}/{seed}",
                        progress=lambda n, base=base: bar.update(base + n - bar.n)))
                summary = summarize(studies, SIZES[name])
                print_table(name, setup, summary, SIZES[name], len(studies))
                report.plot(studies[0], out / f"{name}-{setup.replace(' ', '-')}.png", f"{name}, {setup}")
                figures[name][setup] = summary
        cost = op_cost_ns(next(iter(loaded.values())), args.block_tokens)
    print("\nns per policy operation, a tier of 1,000 chunks on the first workload's key stream (vs LRU): "
          + ", ".join(f"{k} {v:.0f} ({v / cost['lru']:.2f}x)" for k, v in cost.items()))
    figures["op_ns"] = cost
    figures["op_cost_vs_lru"] = {k: v / cost["lru"] for k, v in cost.items()}
    result(_rounded(figures))


def _rounded(value):
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 4) if isinstance(value, float) else value


if __name__ == "__main__":
    main()
