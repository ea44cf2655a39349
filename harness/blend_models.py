"""Small random-weight decoders for the blending tests, built from configs (4 layers: blending selects at
layer 1 and saves work in layers 2-3)."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_decoder(arch: str = "llama", rope: str = "default", seed: int = 0):
    config_cls, model_cls = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**SHAPE, rope_parameters=ROPES[rope])).eval()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assemble(*parts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt from ``parts``: every part but the last is a segment, the last is the query."""
    ids, spans = [], []
    for part in parts[:-1]:
        spans.append((len(ids), len(ids) + len(part)))
        ids += part
    return ids + parts[-1], spans
