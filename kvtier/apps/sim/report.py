"""A study as a terminal table (rich), a JSON document and a PNG of hit ratio against capacity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.apps.sim.study import Study


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def study_table(study: Study, title: str):
    """One row per replay: hit ratios overall and per tier, chunks written per tier below the first (stores,
    promotions and demotions; what admission saves), against LRU and Belady, and the load spread."""
    from rich.table import Table

    tiers = list(dict.fromkeys(t for p in study.points for t in p.result.hit_chunks_by_tier))
    table = Table(title=title, caption=f"ideal (infinite cache): {study.ideal:.3f} of {study.chunks:,} chunks")
    for col in ("capacity", "policy", "chunk hit", "token hit", *(f"{t} hit" for t in tiers),
                *(f"{t} writes" for t in tiers[1:]), "vs LRU",
                "Belady", "gap closed", "prefill max/mean", "wait p99 (s)"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for point in study.points:
        res = point.result
        doc = res.to_json()
        prefill = [r.prefill_tokens for r in res.replicas]
        spread = max(prefill) / (sum(prefill) / len(prefill)) if prefill and sum(prefill) else None
        table.add_row(f"{point.capacity:,}", point.policy, _pct(res.chunk_hit_ratio), _pct(res.token_hit_ratio),
                      *(_pct(doc["hit_ratio_by_tier"].get(t)) for t in tiers),
                      *(f"{res.written_chunks_by_tier.get(t, 0):,}" for t in tiers[1:]), _ratio(study.vs_lru(point)),
                      _pct(point.belady), _pct(study.gap_closed(point)), _ratio(spread),
                      f"{doc['queue_wait_p99_s']:.2f}")
    return table


def replica_table(study: Study):
    """Per replica of every replay: requests, prefill tokens computed and saved."""
    from rich.table import Table

    table = Table(title="per replica")
    for col in ("capacity", "policy", "replica", "requests", "prefill tokens", "saved tokens"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for point in study.points:
        for i, r in enumerate(point.result.replicas):
            table.add_row(f"{point.capacity:,}", point.policy, str(i), f"{r.requests:,}", f"{r.prefill_tokens:,}",
                          f"{r.saved_tokens:,}")
    return table


def print_study(study: Study, title: str) -> None:
    import sys

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)  # logs and pipes get the whole table
    console.print(study_table(study, title))
    if any(len(p.result.replicas) > 1 for p in study.points):
        console.print(replica_table(study))
    for point in study.points:
        res = point.result
        if res.placements_compared:
            console.print(f"{point.capacity:,} {point.policy}: {res.placements_matched} of "
                          f"{res.placements_compared} requests placed on the replica the recorded run's router chose")


def write_json(study: Study, path: Path, config: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, **study.to_json()}, indent=1, default=str))


def plot(study: Study, path: Path, title: str) -> None:
    """Chunk hit ratio against capacity: one line per policy, Belady and the ideal as references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    capacities = sorted({p.capacity for p in study.points})
    for policy in dict.fromkeys(p.policy for p in study.points):
        series = sorted((p.capacity, p.result.chunk_hit_ratio) for p in study.points if p.policy == policy)
        ax.plot([c for c, _ in series], [h for _, h in series], marker="o", label=policy)
    optimum = sorted({(p.capacity, p.belady) for p in study.points if p.belady is not None})
    if optimum:
        ax.plot([c for c, _ in optimum], [b for _, b in optimum], "k--", marker=".", label="Belady (offline)")
    ax.axhline(study.ideal, color="grey", linestyle=":", label="infinite cache")
    if len(capacities) > 1 and capacities[0] > 0 and capacities[-1] / capacities[0] >= 10:
        ax.set_xscale("log")
        ax.set_xticks(capacities)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("capacity (chunks, all replicas' first tiers together)")
    ax.set_ylabel("chunk hit ratio")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
