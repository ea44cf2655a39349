"""kvtier calibrate: every (tier, codec) pair measured through a real KVCache, advice per tier, nothing left
behind in the tiers, and the CLI's figures as JSON."""

from __future__ import annotations

import json

import pytest
import torch

from kvtier.apps.calibrate.measure import calibrate
from kvtier.base.layout import KVSpec
from kvtier.cli import main
from kvtier.tiers import DiskTierConfig, MemoryTierConfig

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def test_calibration_measures_every_tier_and_codec(tmp_path) -> None:
    tiers = [("memory", MemoryTierConfig(capacity_bytes=64 << 20, prefault=False)),
             ("disk", DiskTierConfig(path=tmp_path / "disk", fsync=False))]
    result = calibrate(tiers, spec=SPEC, chunk_tokens=64, sample_bytes=1 << 20, codecs=("raw", "int8"), reps=1)
    assert [c.codec for c in result.codecs] == ["raw", "int8"]
    ratios = {c.codec: c.ratio for c in result.codecs}
    assert ratios["raw"] == 1.0 and ratios["int8"] > 1.8
    assert all(c.encode_gbs > 0 and c.decode_gbs > 0 and c.decode_all_cores_gbs > 0 for c in result.codecs)
    assert {(x.tier, x.codec) for x in result.loads} == {(t, c) for t in ("memory", "disk") for c in ("raw", "int8")}
    assert all(x.load_gbs > 0 and x.store_gbs > 0 for x in result.loads)
    advice = result.advice()
    assert len(advice) == 2 and advice[0].startswith("memory: ") and advice[1].startswith("disk: ")
    assert result.fastest("disk").codec in ("raw", "int8") and "int8 1.9" in advice[1]
    assert "| int8 | 1.9" in result.table()
    left = [p for p in (tmp_path / "disk").rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert left == []  # calibration deletes the chunks it wrote


def test_cli_writes_figures_as_json(tmp_path, capsys) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text("chunk_size: 32\ntiers:\n  - {kind: memory, capacity_bytes: 64MiB, prefault: false}\n")
    out = tmp_path / "cal.json"
    code = main(["calibrate", "--config", str(config), "--spec", "2x2x64", "--mib", "1", "--codecs", "raw",
                 "lossless", "--reps", "1", "--json", str(out)])
    assert code == 0
    figures = json.loads(out.read_text())
    assert [c["codec"] for c in figures["codecs"]] == ["raw", "lossless"]
    assert [(x["tier"], x["codec"]) for x in figures["loads"]] == [("memory", "raw"), ("memory", "lossless")]
    assert "memory: " in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--spec", "2x2"], ["--codecs", "int3"]])
def test_cli_rejects_bad_arguments(tmp_path, argv, capsys) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text("tiers:\n  - {kind: memory, capacity_bytes: 64MiB, prefault: false}\n")
    assert main(["calibrate", "--config", str(config), "--mib", "1", *argv]) == 2
    assert "kvtier calibrate:" in capsys.readouterr().err
