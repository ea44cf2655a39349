"""Tiny random-weight SSM models saved as HF model folders that vLLM's CPU build serves offline: a
GraniteMoeHybrid (Granite-4.0-H shape: Mamba2 layers with one attention layer) and a pure Mamba2, with the
word-level tokenizer of :mod:`harness.window_model` (``w3 w4 ...`` is three tokens).

Used by tests/integrations/test_vllm_hybrid.py and benchmarks/vllm_hybrid.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.window_model import VOCAB, write_tokenizer

#: a dense model of the hybrid's size: its one attention layer's KV per token times the layer count, float32
HYBRID_LAYERS, HYBRID_KV_HEADS, HYBRID_HEAD_DIM = 4, 2, 32


def build_tiny_hybrid(path: Path, kind: str = "granite-hybrid", *, seed: int = 0) -> Path:
    """``kind`` ``granite-hybrid``: 4 layers (mamba, attention, mamba, mamba), hidden size 128, Mamba2 mixers of 8
    heads of 32 dims and state 16, attention of 4 query and 2 KV heads of 32 dims; ``mamba2``: 2 Mamba2 layers of
    the same mixer. Float32 weights drawn from ``seed``. Returns ``path``."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path)
    common = dict(vocab_size=VOCAB, hidden_size=128, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if kind == "mamba2":
        config = transformers.Mamba2Config(**common, num_hidden_layers=2, num_heads=8, head_dim=32, state_size=16,
                                           n_groups=1, expand=2, chunk_size=64)
    elif kind == "granite-hybrid":
        config = transformers.GraniteMoeHybridConfig(
            **common, num_hidden_layers=HYBRID_LAYERS, layer_types=["mamba", "attention", "mamba", "mamba"],
            num_attention_heads=4, num_key_value_heads=HYBRID_KV_HEADS, intermediate_size=256,
            shared_intermediate_size=256, mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
            mamba_chunk_size=64, num_local_experts=0, num_experts_per_tok=0, max_position_embeddings=4096)
    else:
        raise ValueError(f"unknown hybrid kind {kind!r}")
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def dense_bytes_per_token(dtype_bytes: int = 4) -> int:
    """KV bytes per token of a dense model of the hybrid's size (every layer attention, same KV heads)."""
    return 2 * HYBRID_LAYERS * HYBRID_KV_HEADS * HYBRID_HEAD_DIM * dtype_bytes
