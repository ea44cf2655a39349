"""kvtier bench against real servers (uvicorn on free ports, the tiny Llama), and its workload files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.apps.bench import report
from kvtier.apps.bench.cli import bench
from kvtier.apps.bench.client import RequestResult, Target
from kvtier.apps.bench.runner import RunResult
from kvtier.fleet import workloads as wl
from harness.serve import start_server


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    with start_server(tiny_model_dir, chunk_size=16) as on, start_server(tiny_model_dir, cache=False) as off:
        yield [Target("kvtier", on.url), Target("no-cache", off.url)]


def test_multiround_hits_the_cache_only_with_kvtier(servers, tmp_path):
    spec = wl.MultiRoundSpec(users=2, rounds=3, system_words=40, turn_words=15, max_tokens=4)
    on, off = bench(servers, "multiround", spec)
    assert [r.status for r in on.results + off.results] == [200] * 12
    later = [r for r in on.results if r.round > 0]
    assert all(r.cached_tokens and r.cached_tokens >= 16 for r in later)
    assert all(r.cached_tokens == 0 for r in off.results)
    for run in (on, off):  # each user's prompt grows round by round
        for user in (0, 1):
            sizes = [r.prompt_tokens for r in sorted(run.results, key=lambda r: r.round) if r.user == user]
            assert sizes == sorted(sizes) and len(set(sizes)) == 3
    # greedy: both servers saw the same conversations and answered the same
    def answers(results):
        return sorted((r.round, r.user, r.text) for r in results)

    assert answers(on.results) == answers(off.results)
    summary = report.summarize(on)
    assert summary["ok"] == 6 and summary["cached_tokens"] > 0 and summary["hit_tokens_by_tier"]["memory"] > 0
    assert summary["ttft_p50_s"] <= summary["ttft_p90_s"] <= summary["ttft_p99_s"]
    report.write_json([on, off], tmp_path / "r.json", {"workload": "multiround"})
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["runs"][0]["requests"]) == 6 and doc["summaries"][1]["cached_share"] == 0
    report.plot([on, off], tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_stream_that_breaks_after_its_200_counts_as_failed():
    results = [RequestResult("t", "multiround", 0, 0, status=200, ttft_s=0.1, prompt_tokens=10, cached_tokens=5),
               RequestResult("t", "multiround", 0, 1, status=200, error='{"message": "generation failed"}'),
               RequestResult("t", "multiround", 0, 2, status=429), RequestResult("t", "multiround", 0, 3, status=503)]
    summary = report.summarize(RunResult("t", "multiround", results))
    assert (summary["ok"], summary["rejected_429"], summary["failed"]) == (1, 1, 2)


def write_loogle(path: Path) -> None:
    rows = []
    for d in range(2):
        qa = [{"Q": f"What is said about rivers in part {q}?", "A": "x", "type": "t", "S": ["s"]} for q in range(3)]
        rows.append({"input": f"Document {d}. " + "the cache keeps a prefix of every prompt " * 12,
                     "title": f"doc {d}", "qa_pairs": repr(qa), "output": ""})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_qa_reuses_each_document_and_parses_literal_qa_pairs(servers, tmp_path):
    data = tmp_path / "loogle.jsonl"
    write_loogle(data)
    items = wl.load_loogle(data, docs=2, questions=3)
    assert [len(q) for _, q in items] == [3, 3] and items[1][1][2].endswith("part 2?")
    spec = wl.QASpec(path=str(data), docs=2, questions=3, doc_chars=400, order="random", max_tokens=3)
    (on,) = bench(servers[:1], "qa", spec)
    assert len(on.results) == 6 and {r.status for r in on.results} == {200}
    first_visits = [r for r in on.results if r.round == 0]
    repeats = [r for r in on.results if r.round > 0]
    assert all(r.cached_tokens >= 16 for r in repeats)
    assert sum(r.cached_tokens for r in first_visits) < sum(r.cached_tokens for r in repeats)


def test_literal_qa_pairs_are_never_evaluated(tmp_path):
    path = tmp_path / "evil.jsonl"
    path.write_text(json.dumps({"input": "d", "qa_pairs": "__import__('os').getcwd()"}) + "\n")
    with pytest.raises(ValueError):
        wl.load_loogle(path, 1, 1)


def test_trace_blocks_are_deterministic_and_shared_ids_hit(servers, tmp_path):
    assert wl.block_tokens(7, 32, (1000, 2000)) == wl.block_tokens(7, 32, (1000, 2000))
    assert wl.block_tokens(7, 32, (1000, 2000)) != wl.block_tokens(8, 32, (1000, 2000))
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
            {"timestamp": 50, "input_length": 1536, "output_length": 3, "hash_ids": [0, 1, 2]},
            {"timestamp": 90, "input_length": 1024, "output_length": 3, "hash_ids": [5, 6]}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = wl.TraceSpec(path=str(trace), requests=3, block_tokens=32, max_tokens=2, timestamps=True, speed=2.0,
                        token_range=(10, 300))
    prompts = [p for _, p, _ in wl.trace_requests(spec)]
    assert [len(p) for p in prompts] == [64, 96, 64] and prompts[1][:64] == prompts[0]
    (on,) = bench(servers[:1], "trace", spec)
    by_index = {r.round: r for r in on.results}
    assert [by_index[i].status for i in range(3)] == [200] * 3
    assert by_index[1].cached_tokens == 64 and by_index[2].cached_tokens == 0
    assert by_index[1].sent_at >= 0.02  # sent at its (halved) arrival time, not at once


def test_workload_file_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_WORKLOADS", str(tmp_path))
    with pytest.raises(Exception, match="--data"):
        wl.find_workload_file("nothing-here.jsonl", str(tmp_path / "nope.jsonl"))


def test_bench_command_starts_servers_compares_and_stops_them(tiny_model_dir, tmp_path):
    """The whole command: two real `kvtier serve` processes, the table, the JSON and the PNG."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvtier", "bench", "multiround", "--serve", "--serve-args",
           f"--model {tiny_model_dir} --chunk-size 16 --memory-bytes 16MiB", "--users", "1", "--rounds", "2",
           "--system-words", "30", "--turn-words", "10", "--max-tokens", "3", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "speed-up (no-cache / kvtier)" in done.stdout
    doc = json.loads((out / "multiround.json").read_text())
    assert [s["target"] for s in doc["summaries"]] == ["kvtier", "no-cache"]
    assert doc["summaries"][0]["cached_tokens"] > 0 and doc["summaries"][1]["cached_tokens"] == 0
    assert (out / "multiround.png").stat().st_size > 1000
    for log in ("serve-kvtier.log", "serve-no-cache.log"):
        assert "kvtier serve:" in (out / log).read_text()
