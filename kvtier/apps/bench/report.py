"""Summaries of a bench run: TTFT percentiles, throughput, cache hits; a table, a JSON and a PNG plot."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.apps.bench.runner import RunResult


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(run: RunResult) -> dict[str, Any]:
    """Per-run figures: request counts, TTFT p50/p90/p99 (s), throughput, cached prompt-token share."""
    ok = [r for r in run.results if r.status == 200 and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    completion = sum(r.completion_tokens or 0 for r in ok)
    hits_by_tier: dict[str, float] = {}
    for series, value in run.metrics_delta.items():
        if series.startswith("kvtier_hit_tokens_total"):
            tier = series.partition('tier="')[2].partition('"')[0] or "all"
            hits_by_tier[tier] = hits_by_tier.get(tier, 0) + value
    return {
        "target": run.target, "workload": run.workload, "requests": len(run.results), "ok": len(ok),
        "rejected_429": sum(1 for r in run.results if r.status == 429),
        # a stream that broke after its 200 (an error event, no first token) failed too
        "failed": sum(1 for r in run.results if r.status != 429 and not (r.status == 200 and r.ttft_s is not None)),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "wall_s": run.wall_s, "requests_per_s": len(ok) / run.wall_s if run.wall_s else None,
        "output_tokens_per_s": completion / run.wall_s if run.wall_s else None,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0, "hit_tokens_by_tier": hits_by_tier,
    }


def ttft_by_round(run: RunResult) -> dict[int, float]:
    """Median TTFT (s) of each round."""
    rounds: dict[int, list[float]] = defaultdict(list)
    for r in run.results:
        if r.status == 200 and r.ttft_s is not None:
            rounds[r.round].append(r.ttft_s)
    return {k: statistics.median(v) for k, v in sorted(rounds.items())}


def prompt_by_round(run: RunResult) -> dict[int, float]:
    """Mean prompt tokens of each round."""
    rounds: dict[int, list[int]] = defaultdict(list)
    for r in run.results:
        if r.prompt_tokens:
            rounds[r.round].append(r.prompt_tokens)
    return {k: statistics.fmean(v) for k, v in sorted(rounds.items())}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


#: Widest a table may be: the summary and round tables are laid out to fit it (and 80 columns too).
TABLE_WIDTH = 100


def print_tables(runs: list[RunResult], console=None) -> None:
    """Per workload: the summary table and, for round-based workloads, TTFT per round with speed-ups over the
    first target. Output that is not a terminal is laid out at TABLE_WIDTH (rich would assume 80)."""
    import sys

    from rich.console import Console

    if console is None:
        console = Console() if sys.stdout.isatty() else Console(width=TABLE_WIDTH)
    for workload in dict.fromkeys(r.workload for r in runs):
        group = [r for r in runs if r.workload == workload]
        console.print(summary_table(group))
        if workload != "trace":
            console.print(round_table(group))


def summary_table(group: list[RunResult]):
    """One row per target of one workload; the workload is in the title, so no column has to carry it."""
    from rich.table import Table

    table = Table(title=f"{group[0].workload}: TTFT measured on the client (ms)")
    table.add_column("target", no_wrap=True)
    for col in ("ok/sent", "TTFT p50", "p90", "p99", "req/s", "cached prompt"):
        table.add_column(col, justify="right", no_wrap=True)
    for run in group:
        s = summarize(run)
        table.add_row(run.target, f"{s['ok']}/{s['requests']}", _ms(s["ttft_p50_s"]), _ms(s["ttft_p90_s"]),
                      _ms(s["ttft_p99_s"]), f"{s['requests_per_s']:.2f}" if s["requests_per_s"] else "-",
                      f"{s['cached_share']:.0%}")
    return table


def round_table(group: list[RunResult]):
    """Median TTFT per round for each target; with two targets, the speed-up of the first over the second."""
    from rich.table import Table

    table = Table(title=f"{group[0].workload}: median TTFT per round (ms)")
    table.add_column("round", justify="right", no_wrap=True)
    table.add_column("prompt tokens", justify="right", no_wrap=True)
    for run in group:
        table.add_column(run.target, justify="right", no_wrap=True)
    if len(group) == 2:
        table.add_column(f"speed-up ({group[1].target} / {group[0].target})", justify="right", no_wrap=True)
    by_round = [ttft_by_round(run) for run in group]
    prompts = prompt_by_round(group[0])
    for k in sorted(set().union(*by_round)):
        row = [str(k), f"{prompts.get(k, 0):,.0f}"] + [_ms(r.get(k)) for r in by_round]
        if len(group) == 2 and k in by_round[0] and k in by_round[1]:
            row.append(f"{by_round[1][k] / by_round[0][k]:.1f}x")
        table.add_row(*row)
    return table


def write_json(runs: list[RunResult], path: Path, config: dict[str, Any]) -> None:
    """Raw per-request results, summaries and the bench configuration."""
    doc = {"config": config, "summaries": [summarize(r) for r in runs],
           "runs": [{"target": r.target, "workload": r.workload, "wall_s": r.wall_s,
                     "metrics_delta": r.metrics_delta, "requests": [x.to_json() for x in r.results]} for r in runs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def plot(runs: list[RunResult], path: Path) -> None:
    """TTFT per round (median), one line per target, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

    workloads = list(dict.fromkeys(r.workload for r in runs))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for run in (r for r in runs if r.workload == workload):
            series = ttft_by_round(run)
            ax.plot(list(series), [v * 1000 for v in series.values()], marker="o", label=run.target)
        ax.set_title({"multiround": "multi-round chat", "qa": "long-document QA",
                      "trace": "trace replay"}.get(workload, workload))
        ax.set_xlabel({"qa": "times the document was asked before", "trace": "request"}.get(workload, "round"))
        ax.set_ylabel("TTFT, client-measured (ms)")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
