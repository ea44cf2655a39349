"""Inputs beside token ids for vLLM's OpenAI server, built the way a user would: prompt embeddings (rows of the
model's own embedding matrix for random token ids, sent as vLLM's base64 ``torch.save`` payload) and a LoRA
adapter with random weights in PEFT's file layout (``adapter_config.json`` + ``adapter_model.safetensors``).

Used by tests/integrations/test_vllm_inputs_serve.py and benchmarks/vllm_inputs.py.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def embedding_matrix(model: Path) -> torch.Tensor:
    """The model's token embeddings ``[vocab, hidden]`` (float32)."""
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        name = next(k for k in f.keys() if k.endswith("embed_tokens.weight"))
        return f.get_tensor(name).float()


def random_embeds(matrix: torch.Tensor, seed: int, positions: int) -> torch.Tensor:
    """The embedding rows of ``positions`` random token ids: a prompt the model reads as text it never saw."""
    ids = torch.randint(0, matrix.shape[0], (positions,), generator=torch.Generator().manual_seed(seed))
    return matrix[ids].contiguous()


def encode_embeds(embeds: torch.Tensor) -> str:
    """vLLM's ``prompt_embeds`` field: base64 of the tensor's ``torch.save`` bytes."""
    buf = io.BytesIO()
    torch.save(embeds, buf)
    return base64.b64encode(buf.getvalue()).decode()


def save_random_lora(model: Path, out: Path, rank: int = 8, seed: int = 0) -> Path:
    """A LoRA adapter for ``model``'s q_proj and v_proj with random A and B (B non-zero, so the adapter changes
    the outputs), in PEFT's layout; returns ``out``."""
    config = json.loads((model / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_dim = config.get("num_key_value_heads", heads) * config.get("head_dim", hidden // heads)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for module, dim in (("q_proj", hidden), ("v_proj", kv_dim)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.1
            weights[f"{prefix}.lora_B.weight"] = torch.randn(dim, rank, generator=gen) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model), "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False}))
    return out
