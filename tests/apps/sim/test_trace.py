"""Reading traces: Mooncake rows, deterministic token runs, malformed input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtier.apps.sim.synthetic import generate
from kvtier.apps.sim.trace import block_token_ids, is_mooncake, read_mooncake
from kvtier.base.errors import ConfigError
from tests.apps.sim.conftest import SMALL


def test_block_tokens_are_deterministic_and_distinct():
    a = block_token_ids(np.array([7, 8, 7]), 512)
    assert a.dtype == np.dtype("<u4") and a.shape == (1536,)
    assert np.array_equal(a[:512], a[1024:]) and not np.array_equal(a[:512], a[512:1024])
    assert np.array_equal(block_token_ids(np.array([7]), 512), a[:512])  # same on every call and machine
    assert len(set(a[:512].tolist())) > 500


def test_read_mooncake(small_trace):
    requests = read_mooncake(small_trace, block_tokens=16)
    rows = [json.loads(line) for line in small_trace.read_text().splitlines()]
    assert len(requests) == len(rows)
    first = requests[0]
    assert first.input_tokens == rows[0]["input_length"] and first.tokens_per_chunk == 512
    assert len(first.prompt.tokens()) == 16 * len(rows[0]["hash_ids"])
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert len(read_mooncake(small_trace, limit=5)) == 5


def test_cut_tail_drops_the_partial_last_block(small_trace):
    rows = [json.loads(line) for line in small_trace.read_text().splitlines()]
    cut = read_mooncake(small_trace, block_tokens=16, cut_tail=True)
    for row, request in zip(rows, cut):
        assert len(request.prompt.tokens()) == -(-row["input_length"] * 16 // 512)


@pytest.mark.parametrize("line", ['{"timestamp": 0, "input_length": 5}', '{"hash_ids": [1, -2], "input_length": 9}',
                                  "not json", "[1, 2]"])
def test_malformed_rows_are_config_errors_naming_the_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        read_mooncake(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_mooncake(tmp_path / "absent.jsonl")


def test_format_detection(small_trace, tmp_path):
    assert is_mooncake(small_trace)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"config": {}, "runs": []}, indent=1))
    assert not is_mooncake(bench)


def test_synthetic_workload_shares_prefixes_and_cuts_blocks_like_a_server():
    rows = generate(SMALL)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    seen, reused = set(), 0
    for r in rows:
        reused += sum(b in seen for b in r["hash_ids"])
        seen.update(r["hash_ids"])
    assert 0.3 < reused / sum(len(r["hash_ids"]) for r in rows) < 0.95
    assert generate(SMALL) == rows  # seeded
