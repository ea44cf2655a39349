"""benchmarks/vllm_serve.py's report: the table (rich), the PNG (matplotlib) and the targets of issue 33."""

from __future__ import annotations

import math
from pathlib import Path

COLUMNS = ("req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "loaded", "preempt", "CPU s/req (kvtier)", "load avg")


def _ms(seconds: float) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:,.0f} ms"


def _cpu(row: dict) -> str:
    if "cpu_s_per_req" not in row:
        return "-"
    return f"{row['cpu_s_per_req']:.2f} ({row['kvtier_cpu_s_per_req']:.3f})"


def print_table(rows: list[dict], itl: dict, notes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="vLLM's OpenAI server, vLLM's benchmark client (vllm bench serve)", title_justify="left")
    for name in ("workload", "server", "in flight", *COLUMNS, "vs vLLM"):
        table.add_column(name, justify="left" if name in ("workload", "server") else "right")
    for row in rows:
        vs = row.get("vs_alone")
        table.add_row(row["workload"], row["label"], str(row["concurrency"]), f"{row['req_s']:.2f}",
                      _ms(row["ttft_p50"]), _ms(row["ttft_p99"]), _ms(row["itl_p50"]), _ms(row["itl_p99"]),
                      f"{row['loaded_share']:.0%}", f"{row.get('preemptions', 0):.0f}", _cpu(row),
                      f"{row['loadavg']:.1f}", f"{vs:.2f}x" if vs else "")
    console = Console(width=170)
    console.print(table)
    if itl:
        t = Table(title="other streams' ITL while one request loads a long prefix from the disk tier",
                  title_justify="left")
        for name in ("load mode", "prefix", "ITL p50 quiet", "ITL p50 loading", "ITL p99 quiet",
                     "ITL p99 loading", "p99 ratio", "ITL p99 control", "control ratio", "samples", "load request"):
            t.add_column(name, justify="right")
        for mode, m in itl.items():
            control = m.get("itl_p99_control")
            t.add_row(mode, str(m["prefix_tokens"]), _ms(m["itl_p50_quiet"]), _ms(m["itl_p50_loading"]),
                      _ms(m["itl_p99_quiet"]), _ms(m["itl_p99_loading"]), f"{m['ratio']:.2f}x", _ms(control),
                      f"{m['ratio_control']:.2f}x" if control else "-",
                      f"{m['samples_loading']} / {m.get('samples_control', 0)} / {m['samples_quiet']}",
                      _ms(m["load_request_s"]))
        console.print(t)
    for note in notes:
        console.print(f"[dim]{note}[/dim]")


def plot(rows: list[dict], itl: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix = [r for r in rows if r["workload"] == "prefix"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    labels = [f"{r['label']}\n@{r['concurrency']}" for r in prefix]
    colors = ["#999" if r["label"] == "vLLM alone" else "#37c" if "memory" in r["label"]
              else "#6a9" if "disk" in r["label"] else "#c63" for r in prefix]
    axes[0].bar(labels, [r["req_s"] for r in prefix], color=colors)
    axes[0].set(ylabel="requests / s", title="prefix repetition: request throughput")
    axes[1].bar(labels, [r["ttft_p50"] for r in prefix], color=colors)
    axes[1].set(ylabel="TTFT p50 (s)", yscale="log", title="prefix repetition: TTFT p50")
    for ax in axes[:2]:
        ax.tick_params(axis="x", labelsize=7, rotation=60)
        ax.grid(True, axis="y", alpha=0.3)
    if itl:
        modes = list(itl)
        x = range(len(modes))
        axes[2].bar([i - 0.2 for i in x], [itl[m]["itl_p99_quiet"] * 1000 for m in modes], 0.4, label="no load")
        axes[2].bar([i + 0.2 for i in x], [itl[m]["itl_p99_loading"] * 1000 for m in modes], 0.4,
                    label="one request loading from disk")
        axes[2].set_xticks(list(x), modes)
        axes[2].set(ylabel="other streams' ITL p99 (ms)", title="ITL while a long prefix loads")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _row(rows: list[dict], label: str, workload: str = "prefix", concurrency: int = 4) -> dict | None:
    found = [r for r in rows if r["label"] == label and r["workload"] == workload and r["concurrency"] == concurrency]
    return found[0] if found else None


def targets(rows: list[dict], itl: dict, default_mode: str) -> tuple[dict, dict]:
    """(ratios, {target: True/False}) against vLLM alone in the same run; a target whose rows are missing is
    left out."""
    ratios: dict[str, float] = {}
    checks: dict[str, bool] = {}
    alone = _row(rows, "vLLM alone")
    mem = _row(rows, "kvtier memory")
    if alone and mem:
        ratios["memory_req_s_x"] = mem["req_s"] / alone["req_s"]
        ratios["memory_ttft_p50_x"] = alone["ttft_p50"] / mem["ttft_p50"]
        checks["memory: req/s >= 4x vLLM alone @4"] = ratios["memory_req_s_x"] >= 4
        checks["memory: TTFT p50 >= 10x better @4"] = ratios["memory_ttft_p50_x"] >= 10
    for tier in ("disk", "redis"):
        for mode in ("sync", "async"):
            row = _row(rows, f"kvtier {tier} {mode}")
            if alone and row:
                ratios[f"{tier}_{mode}_req_s_x"] = row["req_s"] / alone["req_s"]
                checks[f"{tier} {mode}: req/s >= 3x vLLM alone @4"] = ratios[f"{tier}_{mode}_req_s_x"] >= 3
    mem8 = _row(rows, "kvtier memory", concurrency=8)
    if mem and mem8:
        ratios["memory_req_s_8_vs_4"] = mem8["req_s"] / mem["req_s"]
        checks["memory: req/s @8 >= @4"] = mem8["req_s"] >= mem["req_s"]
    for mode, m in itl.items():
        ratios[f"itl_p99_loading_vs_quiet_{mode}"] = m["ratio"]
        loading_vs_control = m["itl_p99_loading"] / m["itl_p99_control"] if m.get("itl_p99_control") else None
        if loading_vs_control is not None:
            ratios[f"itl_p99_loading_vs_control_{mode}"] = loading_vs_control
        if mode == default_mode:
            # the target's "no load running" is the control (the same arrival, no load): judged there; the
            # ratio to quiet decoding (no arrival at all) is reported beside it, not judged
            if loading_vs_control is not None:
                checks[f"ITL p99 while loading <= 1.2x the same arrival without a load ({mode})"] = \
                    loading_vs_control <= 1.2
            else:
                checks[f"ITL p99 while loading <= 1.2x quiet ({mode})"] = m["ratio"] <= 1.2
    ratios.update(random_pairs(rows))
    if "random_req_s_x" in ratios:
        checks["random prompts: req/s >= 0.98x vLLM alone (pooled)"] = ratios["random_req_s_x"] >= 0.98
    same = [r["same_outputs"] for r in rows if r.get("same_outputs") is not None]
    if same:
        checks["greedy outputs identical to vLLM alone"] = all(same)
    return ratios, checks


def random_pairs(rows: list[dict]) -> dict[str, float]:
    """Random prompts, kvtier's memory tier against vLLM alone: each pair's ratio of request throughput (the two
    runs on the same prompts, one seed), their median, and the pooled ratio (every run's requests over their
    summed durations); kvtier's own threads' CPU seconds per request against the whole server's."""
    alone = {r["seed"]: r for r in rows if r["label"] == "vLLM alone" and r["workload"] == "random"}
    mem = {r["seed"]: r for r in rows if r["label"] == "kvtier memory" and r["workload"] == "random"}
    seeds = sorted(set(alone) & set(mem))
    if not seeds:
        return {}
    pairs = [mem[s]["req_s"] / alone[s]["req_s"] for s in seeds]
    out = {f"random_pair_{i + 1}_x": x for i, x in enumerate(pairs)}
    out["random_median_x"] = sorted(pairs)[len(pairs) // 2] if len(pairs) % 2 else \
        sum(sorted(pairs)[len(pairs) // 2 - 1: len(pairs) // 2 + 1]) / 2
    pooled = [sum(d[s]["requests"] for s in seeds) / sum(d[s]["duration_s"] for s in seeds) for d in (mem, alone)]
    out["random_req_s_x"] = pooled[0] / pooled[1]
    if all("cpu_s_per_req" in d[s] for d in (mem, alone) for s in seeds):
        out["random_cpu_s_per_req_alone"] = sum(alone[s]["cpu_s_per_req"] for s in seeds) / len(seeds)
        out["random_cpu_s_per_req_kvtier_server"] = sum(mem[s]["cpu_s_per_req"] for s in seeds) / len(seeds)
        out["random_kvtier_threads_cpu_s_per_req"] = sum(mem[s]["kvtier_cpu_s_per_req"] for s in seeds) / len(seeds)
    return out
