"""Sticky, shared, or both, as RAM per replica changes: `kvtier sim` on the requests a `vllm_fleet.py` run recorded.

`benchmarks/vllm_fleet.py` measures each choice at one size of kvtier's tiers (and checks `kvtier sim`'s cached
share against every arm). This replays two of its recorded workloads (multi-round chat, the ``sticky`` arm's
requests; Mooncake trace conversations, ``trace-sticky``'s) through the simulator with the fleet file that run
wrote, changing only kvtier's RAM: ``P`` chunks per replica, from an eighth of a replica's share of the
workload's distinct chunks to four times it. The same RAM is spent five ways:

* **round-robin, private**: each replica its own ``P``;
* **sticky, private**: a session back to its replica, ``P`` each;
* **tier-aware, private**: load-bounded prefix affinity over every tier, sticky sessions (kvtier route);
* **round-robin, pooled**: the replicas' RAM pooled into one shared store of ``3P`` (a Mooncake pool);
* **sticky, half pooled**: ``P/2`` private each and a pool of ``3P/2``;

and the reference, **one replica** with all ``3P`` (and the three replicas' device caches). Prints a table per
workload, writes a PNG (``--png``) and ``fleet_choices.json``; last line ``RESULT {json}`` with, per workload and
choice, the least RAM at which it caches 0.9 of what the workload can (one replica with all RAM at the largest
size). Simulation only (a few seconds): the measured points are on the
vllm_fleet page.

    PYTHONPATH=. python benchmarks/fleet_choices.py --runs results/vllm_fleet [--png docs/fleet_choices.png]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.apps.sim.bench_replay import read_bench_json  # noqa: E402
from kvtier.apps.sim.fleet import FleetConfig  # noqa: E402
from kvtier.apps.sim.replay import replay  # noqa: E402

CHUNK = 128  #: tokens per kvtier chunk, as vllm_fleet.py stores them
WORKLOADS = {"multi-round chat": "sticky", "Mooncake trace conversations": "trace-sticky"}
FRACTIONS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
#: label -> (routing, sticky, private share of P, pooled chunks as a multiple of P)
CHOICES = {
    "round-robin, private": ("round-robin", False, 1.0, 0.0),
    "sticky, private": ("round-robin", True, 1.0, 0.0),
    "tier-aware, private": ("load-bounded", True, 1.0, 0.0),
    "round-robin, pooled": ("round-robin", False, 0.0, 3.0),
    "sticky, half pooled": ("round-robin", True, 0.5, 1.5),
}
ENOUGH = 0.9  #: a choice "has enough RAM" once it caches this share of what the workload can
#: the arms of a vllm_fleet.py phase, side by side on the same replicas: one arm replayed alone gets this share of
#: each vLLM device cache (its requests went through it beside the others')
ARMS_SHARING_THE_DEVICE = 5


def distinct_chunks(requests) -> int:
    """How many distinct prefix chunks (of ``CHUNK`` tokens, chained) the requests hold."""
    seen: set[bytes] = set()
    for request in requests:
        tokens = request.prompt.tokens()
        h = hashlib.blake2b(digest_size=16)
        for end in range(CHUNK, len(tokens) + 1, CHUNK):
            h.update(tokens[end - CHUNK : end].tobytes())
            seen.add(h.copy().digest())
    return len(seen)


def fleet_for(base: dict, routing: str, sticky: bool, private: int, pooled: int, replicas: int,
              device_scale: int = 1) -> dict:
    """``base`` (the run's fleet file) with kvtier's RAM and the routing replaced: ``private`` chunks of one LRU
    tier per replica, ``pooled`` in a shared one, and the arm's share of each vLLM device cache (``device_scale``
    times it)."""
    fleet = dict(base, replicas=replicas, routing=routing, sticky=sticky)
    for key in ("tier_weights", "replica_names", "shared"):
        fleet.pop(key, None)
    fleet["vllm_device_blocks"] = max(1, base["vllm_device_blocks"] // ARMS_SHARING_THE_DEVICE) * device_scale
    fleet["tiers"] = [{"kind": "memory", "chunks": max(0, private), "policy": "lru", "admission": "always"}]
    if pooled:
        fleet["shared"] = {"chunks": pooled, "policy": "lru", "admission": "always"}
    return fleet


def study(runs: Path, arm: str) -> dict:
    requests = read_bench_json(runs / f"arm-{arm}.json", chunk_tokens=CHUNK, target=arm)
    base = json.loads((runs / f"fleet-{arm}.yaml").read_text())
    replicas = base["replicas"]
    share = distinct_chunks(requests) / replicas
    rows = []
    for fraction in FRACTIONS:
        p = max(1, round(share * fraction))
        row = {"fraction": fraction, "chunks_per_replica": p}
        for label, (routing, sticky, private, pooled) in CHOICES.items():
            fleet = fleet_for(base, routing, sticky, round(p * private), round(p * pooled), replicas)
            row[label] = replay(requests, FleetConfig.from_dict(fleet), CHUNK, label=label).token_hit_ratio
        one = fleet_for(base, "round-robin", False, p * replicas, 0, 1, device_scale=replicas)
        row["one replica"] = replay(requests, FleetConfig.from_dict(one), CHUNK, label="one").token_hit_ratio
        rows.append(row)
    enough = {}
    best = rows[-1]["one replica"]
    for label in CHOICES:
        hit = [r for r in rows if best and r[label] >= ENOUGH * best]
        enough[label] = hit[0]["fraction"] if hit else None
    return {"arm": arm, "requests": len(requests), "distinct_chunks_per_replica": round(share, 1), "rows": rows,
            "enough_at_fraction": enough}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        x = [r["fraction"] for r in res["rows"]]
        for label in [*CHOICES, "one replica"]:
            ax.plot(x, [r[label] for r in res["rows"]], marker="o", label=label,
                    linestyle="--" if label == "one replica" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("kvtier RAM per replica / its share of the workload's distinct chunks")
        ax.set_ylabel("share of prompt tokens cached (kvtier sim)")
        ax.set_ylim(0, 1)
        ax.set_title(f"{name} ({res['requests']} requests)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="results/vllm_fleet", help="a vllm_fleet.py --out folder")
    p.add_argument("--png", default="docs/fleet_choices.png")
    args = p.parse_args()
    runs = Path(args.runs)
    results = {}
    for name, arm in WORKLOADS.items():
        if not (runs / f"arm-{arm}.json").is_file():
            print(f"{name}: no arm-{arm}.json in {runs}, skipped")
            continue
        results[name] = res = study(runs, arm)
        print(f"\n{name}: {res['requests']} requests, {res['distinct_chunks_per_replica']} distinct chunks per "
              f"replica's share")
        print("RAM/share | " + " | ".join([*CHOICES, "one replica"]))
        for row in res["rows"]:
            print(f"{row['fraction']:>9} | " + " | ".join(f"{row[k]:.3f}" for k in [*CHOICES, "one replica"]))
    if not results:
        raise SystemExit(f"fleet_choices: no recorded arms in {runs}")
    (runs / "fleet_choices.json").write_text(json.dumps(results, indent=1))
    plot(results, Path(args.png))
    out = {"benchmark": "fleet_choices", "runs": str(runs), "enough_share": ENOUGH}
    for name, res in results.items():
        key = "trace" if "trace" in name else "chat"
        for label, fraction in res["enough_at_fraction"].items():
            out[f"{key}_enough_at_{label.replace(', ', '_').replace(' ', '-')}"] = fraction
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
