"""``kvtier sim`` end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def kvtier(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "COLUMNS": "200"}, timeout=600)


def test_sweep_writes_table_json_and_plot(small_trace, tmp_path):
    out = tmp_path / "out"
    run = kvtier("sim", str(small_trace), "--block-tokens", "16", "--capacities", "30,120",
                 "--policies", "arc,s3fifo", "--replicas", "2", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "vs LRU" in run.stdout and "per replica" in run.stdout
    doc = json.loads((out / "sim.json").read_text())
    points = {(p["capacity"], p["policy"]) for p in doc["points"]}
    assert points == {(c, p) for c in (30, 120) for p in ("lru", "arc", "s3fifo")}
    assert all(0 <= p["chunk_hit_ratio"] <= p["belady_chunk_hit_ratio"] <= doc["ideal_chunk_hit_ratio"]
               for p in doc["points"])
    assert doc["config"]["fleet"]["replicas"] == 2
    assert (out / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fleet_file_and_errors(small_trace, tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("replicas: 2\nrouting: prefix\ntiers:\n  - chunks: 40\n    policy: arc-lfu\n"
                     "shared:\n  chunks: 200\n")
    run = kvtier("sim", str(small_trace), "--block-tokens", "16", "--fleet", str(fleet), "--no-belady",
                 "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "shared hit" in run.stdout
    fleet.write_text("replicas: 2\nrouting: nearest\n")
    bad = kvtier("sim", str(small_trace), "--fleet", str(fleet), cwd=tmp_path)
    assert bad.returncode == 2 and "kvtier sim:" in bad.stderr and "routing" in bad.stderr


def test_help_documents_the_fleet_file(tmp_path):
    run = kvtier("sim", "--help", cwd=tmp_path)
    assert run.returncode == 0
    for word in ("replicas:", "tiers:", "shared:", "codec_ratio", "load_epsilon", "write: back"):
        assert word in run.stdout


def test_runs_beside_the_replayed_one_take_its_device_room(tmp_path):
    def bench(name: str, seed: int, users: int, rounds: int, sent) -> str:
        spec = {"users": users, "rounds": rounds, "system_words": 5, "context_words": 300, "turn_words": 5,
                "max_tokens": 4, "seed": seed}
        requests = [{"round": r, "user": u, "status": 200, "sent_at": sent(r, u), "e2e_s": 1.0,
                     "completion_tokens": 4, "text": "fine", "replica": "10.0.0.1:8000"}
                    for r in range(rounds) for u in range(users)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"config": {"workload": "multiround", "spec": spec},
                                    "runs": [{"target": name, "requests": requests}]}))
        return str(path)

    mine = bench("mine", 1, 1, 2, lambda r, u: 10.0 * r)  # one conversation, its second turn 10 s after the first
    beside = bench("beside", 2, 4, 1, lambda r, u: 2.0 + u)  # four others on the same replica in between
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("replica_names: ['10.0.0.1:8000']\nvllm_block_size: 16\nvllm_device_blocks: 48\n"
                     "tiers:\n  - chunks: 0\n")

    def hit_ratio(*more: str) -> float:
        out = tmp_path / f"out{len(more)}"
        run = kvtier("sim", mine, "--chunk-tokens", "64", "--fleet", str(fleet), "--no-belady", "--out", str(out),
                     *more, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        return json.loads((out / "sim.json").read_text())["points"][0]["token_hit_ratio"]

    assert hit_ratio() > 0.3  # the second turn finds the first on the device
    assert hit_ratio("--background", beside, mine) == 0.0  # the others evicted it (mine itself left out)
