"""Random-weight SSM models saved as HF model folders that vLLM's CPU build serves offline: a GraniteMoeHybrid
(Granite-4.0-H shape: Mamba2 layers with a few attention layers; tiny for the tests, ``SMALL`` for benchmarks) and a
pure Mamba2, with the word-level tokenizer of :mod:`harness.window_model` (``w3 w4 ...`` is three tokens).

Used by tests/integrations/test_vllm_hybrid.py, tests/integrations/test_vllm_ssm_cache.py and
benchmarks/vllm_hybrid.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.window_model import VOCAB, write_tokenizer

#: the tests' hybrid: 4 layers (mamba, attention, mamba, mamba), hidden size 128, Mamba2 mixers of 8 heads of 32
#: dims and state 16, attention of 4 query and 2 KV heads of 32 dims, 512 words
TINY = {"hidden": 128, "intermediate": 256, "layers": 4, "attention": (1,), "heads": 4, "kv_heads": 2,
        "head_dim": 32, "mamba_heads": 8, "state": 16, "vocab": VOCAB}
#: a Granite-4.0-H shape near SmolLM2-135M's size (about 170M parameters): hidden size 576, 24 layers of which 3
#: attention (9 query and 3 KV heads of 64 dims; Granite-4.0-H-350M has 4 of 32), Mamba2 mixers of 36 heads of 32
#: dims, 49,152 words. Its SSM state is 16 wide (Granite's is 128) so that one layer's state fits the attention KV
#: of 64 tokens: vLLM's Mamba block stays 64 tokens, the prefill step its CPU build's align mode allows
SMALL = {"hidden": 576, "intermediate": 1536, "layers": 24, "attention": (7, 15, 23), "heads": 9, "kv_heads": 3,
         "head_dim": 64, "mamba_heads": 36, "state": 16, "vocab": 49152}
#: the tiny hybrid's attention: 4 layers, 2 KV heads of 32 dims (a dense model of its size)
HYBRID_LAYERS, HYBRID_KV_HEADS, HYBRID_HEAD_DIM = TINY["layers"], TINY["kv_heads"], TINY["head_dim"]


def build_tiny_hybrid(path: Path, kind: str = "granite-hybrid", *, seed: int = 0, shape: dict = TINY) -> Path:
    """``kind`` ``granite-hybrid``: a GraniteMoeHybrid of ``shape`` (TINY or SMALL); ``mamba2``: 2 Mamba2 layers of
    the tiny shape's mixer. Float32 weights drawn from ``seed``. Returns ``path``."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, shape["vocab"])
    common = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if kind == "mamba2":
        config = transformers.Mamba2Config(**common, num_hidden_layers=2, num_heads=8, head_dim=32, state_size=16,
                                           n_groups=1, expand=2, chunk_size=64)
    elif kind == "granite-hybrid":
        types = ["attention" if i in shape["attention"] else "mamba" for i in range(shape["layers"])]
        config = transformers.GraniteMoeHybridConfig(
            **common, num_hidden_layers=shape["layers"], layer_types=types, num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate"],
            shared_intermediate_size=shape["intermediate"], mamba_n_heads=shape["mamba_heads"], mamba_d_head=32,
            mamba_d_state=shape["state"], mamba_n_groups=1, mamba_chunk_size=64, num_local_experts=0,
            num_experts_per_tok=0, max_position_embeddings=4096)
    else:
        raise ValueError(f"unknown hybrid kind {kind!r}")
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def dense_bytes_per_token(dtype_bytes: int = 4, shape: dict = TINY) -> int:
    """KV bytes per token of a dense model of the hybrid's size (every layer attention, same KV heads)."""
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * dtype_bytes
