"""The admin API on the vLLM connector's metrics port, against a real in-process engine (a tiny random Llama,
memory tier): after a generate a lookup shows each prompt's cached prefix, a pin shows in the tier's pinned
bytes, a clear empties the tier and the next identical generate is a kvtier miss with the same tokens; a wrong
key is refused and /metrics is still served. The server without an engine: test_vllm_admin_server.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.net.ports import free_port  # noqa: E402
from tests.integrations.vllm_model import build_tiny_llama, prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [prompt_ids(11, 300), prompt_ids(12, 100)]
CHUNK, KEY = 64, "vllm-admin-key"


def lookup(prompt: list[int], key: str | None = KEY) -> list:
    return ["POST", "/admin/v1/lookup", {"tokens": prompt}, key]


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("vllm-admin")
    build_tiny_llama(work / "model")
    (work / "admin.key").write_text(KEY + "\n")
    kvtier = {"chunk_size": CHUNK, "metrics_port": free_port(), "admin_key_file": str(work / "admin.key"),
              "tiers": [{"kind": "memory", "capacity_bytes": "64MiB", "pin_budget_bytes": "8MiB"}]}
    admin = {
        "cached": [lookup(PROMPTS[0]), lookup(PROMPTS[1]), ["POST", "/admin/v1/pin", {"tokens": PROMPTS[0]}, KEY],
                   ["GET", "/admin/v1/stats", None, KEY]],
        "refused": [lookup(PROMPTS[0], "not-the-key"), lookup(PROMPTS[0], None),
                    ["POST", "/admin/v1/clear", {"scope": "all"}, "not-the-key"]],
        "clear": [["POST", "/admin/v1/clear", {"scope": "model"}, KEY], lookup(PROMPTS[0]),
                  ["GET", "/admin/v1/stats", None, KEY]],
    }
    spec = {"model": str(work / "model"), "prompts": PROMPTS, "kvtier": kvtier, "admin": admin,
            "steps": ["gen:cold", "reset", "admin:cached", "admin:refused", "scrape:rank0", "admin:clear", "reset",
                      "gen:after_clear"]}
    proc, out = run_engine_spec(work, "admin", spec, in_process=True)
    assert proc.returncode == 0, f"engine failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(Path(out).read_text())


def test_lookup_shows_each_prompts_cached_prefix_and_pins_count(record: dict) -> None:
    first, second, pin, stats = record["cached"]
    assert [a["status"] for a in record["cached"]] == [200] * 4, record["cached"]
    assert first["json"]["cached_tokens"] == 256 and first["json"]["tiers"] == {"memory": 256}  # 4 full chunks
    assert second["json"]["cached_tokens"] == 64 and second["json"]["tiers"] == {"memory": 64}
    assert pin["json"] == {"tiers": {"memory": 256}}
    memory = stats["json"]["tiers"]["memory"]
    assert memory["entries"] == 5 and 0 < memory["pinned_bytes"] <= memory["used_bytes"]
    assert memory["pinned_bytes"] == memory["used_bytes"] * 4 // 5  # four of five equal chunks are pinned


def test_a_wrong_or_missing_key_is_refused_and_metrics_stay_open(record: dict) -> None:
    assert [a["status"] for a in record["refused"]] == [403, 401, 403]
    assert "kvtier_" in record["rank0"]


def test_clear_empties_the_tier_and_the_next_generate_misses_with_the_same_tokens(record: dict) -> None:
    clear, after, stats = record["clear"]
    assert clear["status"] == 200 and clear["json"]["removed"] == {"memory": 5}
    assert after["json"]["cached_tokens"] == 0
    assert stats["json"]["tiers"]["memory"]["entries"] == 0 and stats["json"]["tiers"]["memory"]["pinned_bytes"] == 0
    assert [o["cached"] for o in record["after_clear"]] == [0, 0]
    assert [o["tokens"] for o in record["after_clear"]] == [o["tokens"] for o in record["cold"]]
