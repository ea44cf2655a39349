"""KVTierConnector on vLLM 0.32 (CPU) with SSM models: it refuses them cleanly, never serving wrong output.

vLLM's CPU build runs Mamba2 and Granite 4's hybrid (GraniteMoeHybrid) only with its own prefix caching off:
the boundary-aligned mode that would expose SSM state at block boundaries fails in its Mamba2 mixer on CPU.
The connector moves attention KV only, so with a pure Mamba2 it stops the engine with a ConfigError naming
the model; with a hybrid, vLLM itself refuses to start because the connector does not declare support for its
hybrid KV cache manager. Either way the engine produces no output.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm_model import VOCAB, prompt_ids, run_engine_spec  # noqa: E402

pytestmark = pytest.mark.slow


def build(path: Path, kind: str) -> Path:
    """A tiny random-weight Mamba2 or GraniteMoeHybrid with vllm_model's word-level tokenizer."""
    import torch
    import transformers

    from tests.integrations.vllm_model import build_tiny_llama

    build_tiny_llama(path)  # the tokenizer and generation config; its Llama weights are replaced below
    common = dict(vocab_size=VOCAB, hidden_size=128, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if kind == "mamba2":
        config = transformers.Mamba2Config(**common, num_hidden_layers=2, num_heads=8, head_dim=32, state_size=16,
                                           n_groups=1, expand=2, chunk_size=64)
    else:
        config = transformers.GraniteMoeHybridConfig(
            **common, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, shared_intermediate_size=256,
            mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=64,
            num_local_experts=0, num_experts_per_tok=0, max_position_embeddings=4096)
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    return path


def run_engine(workdir: Path, kind: str) -> tuple[subprocess.CompletedProcess, Path]:
    model = build(workdir / kind, kind)
    spec = {"model": str(model), "prompts": [prompt_ids(1, 200)], "steps": ["gen:first"], "block_size": None,
            "kvtier": {"chunk_size": 256, "tiers": [{"kind": "memory", "capacity_bytes": "64MiB"}]}}
    return run_engine_spec(workdir, kind, spec, in_process=True)


def test_pure_mamba2_is_refused_by_the_connector(tmp_path):
    proc, out = run_engine(tmp_path, "mamba2")
    assert proc.returncode != 0 and not out.exists()
    assert "KVTierConnector supports attention-only models; Mamba2ForCausalLM keeps SSM (Mamba) state" in proc.stderr


def test_hybrid_is_refused_at_startup(tmp_path):
    proc, out = run_engine(tmp_path, "granite-hybrid")
    assert proc.returncode != 0 and not out.exists()
    logs = proc.stdout + proc.stderr
    assert "does not support it" in logs  # vLLM: the connector does not declare support for its hybrid KV manager
    assert "Failed to promote local KV cache specs" in logs
