"""What people read from kvtier bench: one live display with a row per target, tables that fit 100 columns."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvtier.apps.bench import report
from kvtier.apps.bench.client import RequestResult
from kvtier.apps.bench.progress import BenchProgress
from kvtier.apps.bench.runner import RunResult


def recording_console(width: int) -> Console:
    return Console(file=io.StringIO(), width=width, record=True, force_terminal=False, color_system=None)


def fake_run(target: str, workload: str, rounds: int = 4) -> RunResult:
    """A finished run as the runner records it (requests answered by a server; values vary by round)."""
    results = [RequestResult(target, workload, r, u, status=200, ttft_s=0.05 * (r + 1) + 0.01 * u,
                             prompt_tokens=1000 * (r + 1), cached_tokens=900 * r, completion_tokens=8)
               for r in range(rounds) for u in range(2)]
    return RunResult(target, workload, results, wall_s=3.5)


def test_two_targets_share_one_display_with_a_row_each():
    console = recording_console(100)
    with BenchProgress(console) as progress:
        rows = [progress.row("multiround @ kvtier", 3), progress.row("multiround @ no-cache", 3)]
        for i in range(3):
            for row in rows:
                row.advance(0.012 * (i + 1), 64 * i)
    lines = [line for line in console.export_text().splitlines() if line.strip()]
    assert len(lines) == 2, lines  # one final render: a row per target, no interleaved bar lines
    assert lines[0].startswith("multiround @ kvtier") and lines[1].startswith("multiround @ no-cache")
    assert all("3/3" in line and "TTFT 36 ms" in line and "cached 128" in line for line in lines)


@pytest.mark.parametrize("width", [100, 80])
@pytest.mark.parametrize("workload", ["multiround", "qa", "trace"])
def test_tables_fit_the_width_without_cutting_names(width, workload):
    console = recording_console(width)
    report.print_tables([fake_run("kvtier", workload), fake_run("no-cache", workload)], console=console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text  # nothing was cut to fit
    assert f"{workload}: TTFT measured on the client" in text
    assert "kvtier" in text and "no-cache" in text
    if workload != "trace":
        assert "speed-up (no-cache / kvtier)" in text
        assert "1.0x" in text  # the same TTFTs on both sides


def test_speed_ups_are_second_over_first_per_round():
    fast, slow = fake_run("kvtier", "multiround"), fake_run("no-cache", "multiround")
    for r in slow.results:
        r.ttft_s *= 3
    console = recording_console(100)
    console.print(report.round_table([fast, slow]))
    rows = [line for line in console.export_text().splitlines() if line.strip().startswith(("│", "|"))]
    speedups = [line.split("│")[-2].strip() for line in rows if line.count("│") > 2]
    assert speedups[-4:] == ["3.0x"] * 4
