"""KVTierConnector on vLLM 0.32 (CPU) with SSM models and vLLM's prefix caching off: served uncached, with vLLM's
hybrid KV cache manager on.

Without prefix caching vLLM keeps no Mamba state at block boundaries (its ``mamba_cache_mode`` is ``none``), and
attention KV without the recurrent state at the same token cannot resume a request; a pure Mamba2 model has no
full-attention group either. So such a model runs exactly as vLLM alone runs it: the connector declares support
for the hybrid manager (vLLM starts, where it refused a hybrid with a connector that does not), logs once that it
serves the model uncached, and looks up, loads and stores nothing. Outputs must be vLLM alone's, token for token,
a repeated prompt included. With prefix caching on, a hybrid is cached: test_vllm_ssm_cache.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from harness.hybrid_model import build_tiny_hybrid  # noqa: E402
from tests.integrations.vllm_model import prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow
UNCACHED = "it is served uncached (every request computed as by vLLM alone)"
HMA_OFF = "Turning off hybrid kv cache manager"


def run_engine(workdir: Path, model: Path, name: str, kvtier: bool) -> tuple[subprocess.CompletedProcess, dict]:
    # vLLM's own prefix caching off: for Mamba layers it means its boundary-aligned state mode, which fails in the
    # Mamba2 mixer on vLLM's CPU build (vLLM alone included) unless every prefill step is one Mamba block
    spec = {"model": str(model), "prompts": [prompt_ids(1, 300), prompt_ids(2, 100)], "max_tokens": 8,
            "steps": ["gen:first", "gen:again"], "block_size": None, "prefix_caching": False,
            "kvtier": {"chunk_size": 256, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]} if kvtier else None}
    proc, out = run_engine_spec(workdir, name, spec, in_process=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["granite-hybrid", "mamba2"])
def test_ssm_models_are_served_uncached_like_vllm_alone(tmp_path, kind):
    model = build_tiny_hybrid(tmp_path / kind, kind)
    _, plain = run_engine(tmp_path, model, f"{kind}-plain", kvtier=False)
    proc, cached = run_engine(tmp_path, model, f"{kind}-kvtier", kvtier=True)
    logs = proc.stdout + proc.stderr
    assert UNCACHED in logs and HMA_OFF not in logs
    for step in ("first", "again"):
        assert [r["tokens"] for r in cached[step]] == [r["tokens"] for r in plain[step]]
    assert len(set(plain["first"][0]["tokens"])) > 1, "one token repeated: a useless comparison"
