"""Admission policies for a disk tier and a shared tier: hit ratio against bytes written, through ``kvtier sim``.

Replays the Mooncake synthetic trace (``../shared/workloads/``, every 512-token block one chunk) through the
simulator's real KVCaches (kvtier.apps.sim: real tiers, eviction policies and the same admission classes as a
server, their rate caps on the trace's clock), in three setups, each with a memory tier of ``--memory-chunks``
per replica at ``always``:

* ``disk-through``: one cache, a disk tier of ``--disk-chunks`` written through;
* ``disk-back``: the same disk written back (it receives what memory evicts);
* ``shared``: 4 replicas behind load-bounded affinity routing, and one shared tier (a Redis/Valkey store) of
  ``--shared-chunks`` written through by all of them.

For the disk or shared tier, three policies: ``always``, ``second-hit``, and ``always`` under a byte-rate cap
of ``--cap-share`` of the rate ``always`` wrote at (over the trace's duration; per replica for the shared
tier). Bytes are the served model's raw KV (``--kv-bytes-per-token``, Llama-3-8B bf16 by default) per chunk.

The default rule (printed, and applied per setup): the policy with the most hits in the tier per chunk
written to it, unless it loses more than ``--max-hit-loss`` (relative) of ``always``'s overall chunk hit
ratio; the rate cap is no candidate (its rate is a property of the deployment, not of the trace).

Prints a table, writes ``admission.png`` and ``admission.json`` under ``--out`` and ends with ``RESULT {json}``.

    python benchmarks/admission.py [--limit N] [--out results/admission]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import result  # noqa: E402

from kvtier.apps.sim.fleet import FleetConfig, SimTier, TierKind  # noqa: E402
from kvtier.apps.sim.replay import SimResult, replay  # noqa: E402
from kvtier.apps.sim.trace import read_mooncake  # noqa: E402
from kvtier.fleet.scoring import Routing, RoutingConfig  # noqa: E402
from kvtier.fleet.workloads import find_workload_file  # noqa: E402
from kvtier.tiers import WriteMode  # noqa: E402

GiB = 2**30
POLICIES = ("always", "second-hit", "rate cap")


def fleets(args: argparse.Namespace) -> dict[str, tuple[FleetConfig, str]]:
    """Each setup's fleet (the gated tier at ``always``) and the name of the tier admission is set on."""
    memory = SimTier(chunks=args.memory_chunks, admission="always")
    disk = SimTier(kind=TierKind.DISK, chunks=args.disk_chunks, admission="always")
    base = FleetConfig(kv_bytes_per_token=args.kv_bytes_per_token)
    return {
        "disk-through": (dataclasses.replace(base, tiers=(memory, disk)), "disk"),
        "disk-back": (dataclasses.replace(base, tiers=(memory, dataclasses.replace(disk, write=WriteMode.BACK))),
                      "disk"),
        "shared": (dataclasses.replace(base, replicas=4, tiers=(memory,), routing=RoutingConfig(Routing.LOAD_BOUNDED),
                                       shared=SimTier(chunks=args.shared_chunks, admission="always")), "shared"),
    }


def gated(fleet: FleetConfig, tier: str, **admission) -> FleetConfig:
    """``fleet`` with the admission options of ``tier`` (disk: the last own tier; shared: the shared one)."""
    if tier == "shared":
        assert fleet.shared is not None
        return dataclasses.replace(fleet, shared=dataclasses.replace(fleet.shared, **admission))
    return dataclasses.replace(fleet, tiers=(*fleet.tiers[:-1], dataclasses.replace(fleet.tiers[-1], **admission)))


def figures(res: SimResult, tier: str, chunk_bytes: int, duration_s: float, replicas: int) -> dict:
    written = res.written_chunks_by_tier.get(tier, 0)
    hits = res.hit_chunks_by_tier.get(tier, 0)
    return {"hit": res.chunk_hit_ratio, "tier_hit": hits / res.chunks if res.chunks else 0.0,
            "written_chunks": written, "written_gib": written * chunk_bytes / GiB,
            "write_gib_per_s": written * chunk_bytes / GiB / duration_s,
            "per_replica_write_gib_per_s": written * chunk_bytes / GiB / duration_s / replicas,
            "refused_chunks": res.refused_chunks_by_tier.get(tier, 0),
            "tier_hits_per_write": hits / written if written else 0.0}


def choose(rows: dict[str, dict], max_hit_loss: float) -> str:
    """The default rule (see the module's docstring)."""
    floor = rows["always"]["hit"] * (1 - max_hit_loss)
    candidates = [p for p in ("always", "second-hit") if rows[p]["hit"] >= floor]
    return max(candidates, key=lambda p: rows[p]["tier_hits_per_write"])


def plot(out: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(out)
    fig, (hit_ax, write_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        xs = [s + (i - 1) * width for s in range(len(setups))]
        hit_ax.bar(xs, [out[s][policy]["hit"] for s in setups], width, label=policy)
        write_ax.bar(xs, [out[s][policy]["written_gib"] / 1024 for s in setups], width, label=policy)
    for ax, label in ((hit_ax, "chunk hit ratio (all tiers)"), (write_ax, "TiB written to the gated tier")):
        ax.set_xticks(range(len(setups)))
        ax.set_xticklabels(setups)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    hit_ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-chunks", type=int, default=1_000, help="memory tier per replica (always)")
    parser.add_argument("--disk-chunks", type=int, default=8_000)
    parser.add_argument("--shared-chunks", type=int, default=16_000)
    parser.add_argument("--cap-share", type=float, default=0.5, help="the rate cap, as a share of always's rate")
    parser.add_argument("--max-hit-loss", type=float, default=0.10,
                        help="default rule: the most a policy may lose of always's hit ratio (relative)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131_072)
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--out", default="results/admission")
    args = parser.parse_args()
    requests = read_mooncake(find_workload_file("mooncake_synthetic_trace.jsonl"), block_tokens=512,
                             limit=args.limit)
    duration = max(requests[-1].arrival_s - requests[0].arrival_s, 1.0)
    chunk_bytes = args.kv_bytes_per_token * 512
    setups = fleets(args)
    out: dict[str, dict] = {}
    with tqdm(total=len(requests) * len(setups) * len(POLICIES), desc="replays", unit="req", mininterval=2.0) as bar:
        for name, (fleet, tier) in setups.items():
            rows: dict[str, dict] = {}
            for policy in POLICIES:
                if policy == "rate cap":
                    cap = int(rows["always"]["per_replica_write_gib_per_s"] * GiB * args.cap_share)
                    config = gated(fleet, tier, admission="always", admission_max_bytes_per_s=cap)
                else:
                    config = gated(fleet, tier, admission=policy)
                base = bar.n
                res = replay(requests, config, 512, label=f"{name} {policy}",
                             progress=lambda n, base=base: bar.update(base + n - bar.n))
                rows[policy] = figures(res, tier, chunk_bytes, duration, fleet.replicas)
                if policy == "rate cap":
                    rows[policy]["cap_gib_per_s"] = cap / GiB
            rows["default"] = choose(rows, args.max_hit_loss)
            out[name] = rows
    print(f"\nMooncake trace, {len(requests):,} requests over {duration:,.0f} s; chunks of 512 tokens = "
          f"{chunk_bytes / 2**20:.0f} MiB of KV; memory {args.memory_chunks:,} chunks per replica (always)")
    print("| setup | policy | chunk hit | tier hit | written to the tier (TiB) | vs always | GiB/s per replica "
          "| tier hits per write |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in out.items():
        for policy in POLICIES:
            r = rows[policy]
            label = policy + (f" ({r['cap_gib_per_s']:.2f} GiB/s)" if policy == "rate cap" else "")
            print(f"| {name} | {label} | {r['hit']:.3f} | {r['tier_hit']:.3f} | {r['written_gib'] / 1024:.2f} | "
                  f"{r['written_chunks'] / max(rows['always']['written_chunks'], 1):.2f}x | "
                  f"{r['per_replica_write_gib_per_s']:.2f} | {r['tier_hits_per_write']:.2f} |")
    print(f"\ndefault rule: most tier hits per chunk written, losing at most {args.max_hit_loss:.0%} of always's "
          "hit ratio: " + ", ".join(f"{name} -> {rows['default']}" for name, rows in out.items()))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "admission.json").write_text(json.dumps({"config": vars(args), "setups": out}, indent=1))
    plot(out, path / "admission.png", f"Admission on the Mooncake trace ({len(requests):,} requests)")
    print(f"results: {path / 'admission.json'}   plot: {path / 'admission.png'}")
    result({f"{name}.{policy}.{k}": rows[policy][k] for name, rows in out.items() for policy in POLICIES
            for k in ("hit", "written_gib")} | {f"{name}.default": rows["default"] for name, rows in out.items()})


if __name__ == "__main__":
    main()
