"""benchmarks/vllm_hybrid.py's report: the table (rich), the PNG (matplotlib) and the targets (ratios against vLLM
alone measured in the same run)."""

from __future__ import annotations

import math
from pathlib import Path

ALONE, KVTIER, KVTIER_OFF = "vLLM alone", "kvtier (HMA on)", "kvtier (HMA off)"
ALONE_OFF = "vLLM alone (HMA off)"
ALONE_ALIGN = "vLLM alone (align)"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:,.0f} ms"


def _row(rows: list[dict], model: str, label: str, workload: str) -> dict | None:
    found = [r for r in rows if r["model"] == model and r["label"] == label and r["workload"] == workload]
    return found[0] if found else None


def targets(run: dict) -> tuple[dict, dict]:
    """(ratios, {target: True/False}); a target whose rows are missing is left out."""
    rows, ratios, checks = run["rows"], {}, {}

    def ratio(key: str, model: str, label: str, workload: str, field: str, better: str = "higher") -> float | None:
        base, row = _row(rows, model, ALONE, workload), _row(rows, model, label, workload)
        if base and row and row[field] and base[field]:
            ratios[key] = row[field] / base[field] if better == "higher" else base[field] / row[field]
            return ratios[key]
        return None

    for label, tag in ((KVTIER, "hma_on"), (KVTIER_OFF, "hma_off"), (ALONE_OFF, "alone_hma_off"), (ALONE_ALIGN, "alone_align")):
        for workload in ("prefix", "random"):
            ratio(f"window_{tag}_{workload}_req_s_x", "window", label, workload, "req_s")
            ratio(f"window_{tag}_{workload}_ttft_p50_x", "window", label, workload, "ttft_p50", "lower")
        ratio(f"hybrid_{tag}_prefix_ttft_p50_x", "hybrid", label, "prefix", "ttft_p50", "lower")
        ratio(f"hybrid_{tag}_random_req_s_x", "hybrid", label, "random", "req_s")
    if "window_hma_on_random_req_s_x" in ratios:
        checks["window: random req/s >= 1.0x vLLM alone"] = ratios["window_hma_on_random_req_s_x"] >= 1.0
    if "window_hma_on_prefix_req_s_x" in ratios:
        checks["window: prefix req/s >= 5x vLLM alone"] = ratios["window_hma_on_prefix_req_s_x"] >= 5.0
    if "hybrid_hma_on_prefix_ttft_p50_x" in ratios:
        checks["hybrid: prefix TTFT p50 >= 5x better than vLLM alone"] = ratios["hybrid_hma_on_prefix_ttft_p50_x"] >= 5
    on, off = _row(rows, "window", KVTIER, "prefix"), _row(rows, "window", KVTIER_OFF, "prefix")
    if on and off and off.get("bytes_per_token"):
        ratios["window_bytes_per_token_hma_on"] = on["bytes_per_token"]
        ratios["window_bytes_per_token_dense"] = off["bytes_per_token"]
        ratios["window_bytes_vs_dense"] = on["bytes_per_token"] / off["bytes_per_token"]
    hybrid = _row(rows, "hybrid", KVTIER, "prefix")
    if hybrid and "bytes_per_token" in hybrid:
        ratios["hybrid_bytes_per_token"] = hybrid["bytes_per_token"]
        ratios["hybrid_bytes_vs_dense"] = hybrid["bytes_per_token"] / run["dense_hybrid_bytes_per_token"]
    same = [r["same_outputs"] for r in rows if r.get("same_outputs") is not None]
    if same:
        checks["greedy outputs identical to vLLM alone"] = all(same)
    return ratios, checks


def print_table(run: dict, ratios: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="vLLM's OpenAI server, vLLM's benchmark client, 4 in flight", title_justify="left")
    columns = ("model", "workload", "server", "req/s", "TTFT p50", "TTFT p99", "ITL p99", "loaded", "vLLM hits", "preempt",
               "B/token stored", "vs vLLM req/s", "vs vLLM TTFT p50")
    for name in columns:
        table.add_column(name, justify="left" if name in ("model", "workload", "server") else "right")
    for row in run["rows"]:
        base = _row(run["rows"], row["model"], ALONE, row["workload"])
        vs = row["req_s"] / base["req_s"] if base and row["label"] != ALONE else None
        vt = base["ttft_p50"] / row["ttft_p50"] if base and row["label"] != ALONE else None
        stored = f"{row['bytes_per_token']:,.0f}" if "bytes_per_token" in row else ""
        table.add_row(row["model"], row["workload"], row["label"], f"{row['req_s']:.2f}", _ms(row["ttft_p50"]),
                      _ms(row["ttft_p99"]), _ms(row["itl_p99"]), f"{row['loaded_share']:.0%}",
                      f"{row['device_share']:.0%}" if "device_share" in row else "-",
                      f"{row['preemptions']:.0f}", stored, f"{vs:.2f}x" if vs else "", f"{vt:.2f}x" if vt else "")
    for arm, line in run["failed"].items():
        model, label = arm.split(": ", 1)
        table.add_row(model, "-", label, "could not start", line[:60] + "...", *[""] * 8)
    console = Console(width=170)
    console.print(table)
    for arm, line in run["failed"].items():
        console.print(f"{arm} could not start: {line}")
    console.print(f"dense model of the hybrid's size: {run['dense_hybrid_bytes_per_token']:,} B/token (computed)")
    for note in run["notes"]:
        console.print(f"[dim]{note}[/dim]")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.6))
    labels = [f"{r['model']} {r['workload']}\n{r['label']}" for r in rows]
    palette = {ALONE: "#999", KVTIER: "#37c", KVTIER_OFF: "#c63", ALONE_OFF: "#ccc", ALONE_ALIGN: "#ccc"}
    colors = [palette.get(r["label"], "#c63") for r in rows]
    axes[0].bar(labels, [r["req_s"] for r in rows], color=colors)
    axes[0].set(ylabel="requests / s", title="request throughput (4 in flight)")
    axes[1].bar(labels, [r["ttft_p50"] for r in rows], color=colors)
    axes[1].set(ylabel="TTFT p50 (s)", yscale="log", title="TTFT p50")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7, rotation=60)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
