"""Moving cached keys to new positions with the model's own rotary embedding.

A segment's KV is computed once at a fixed base position and reused wherever the segment sits in a later
prompt. Values carry no position; keys were rotated by RoPE for the position they were computed at. RoPE
rotations compose, ``R(p) = R(p - b) R(b)``, so keys computed at ``b`` become keys at ``p`` by one more
rotation by ``p - b``. That is exact (to floating point) for every RoPE whose frequencies are fixed:

* ``default``, ``linear``, ``llama3`` and ``yarn``. YaRN also scales cos and sin by an attention factor; the
  cached keys already carry it, so the extra rotation is the pure one (the factor divided back out).
* ``dynamic`` NTK and ``longrope`` change their frequencies with the sequence length, so keys computed for a
  short segment are not a rotation away from keys inside a long prompt: unsupported.

The frequencies and the rotation itself come from the model (its ``rotary_emb`` module, built by
transformers from ``ROPE_INIT_FUNCTIONS``, and its modeling module's ``apply_rotary_pos_emb``), so theta,
scaling and the half-split layout are the model's, never re-derived here.
"""

from __future__ import annotations

import sys

import torch

from kvtier.base.errors import ConfigError

#: RoPE types whose frequencies do not depend on the sequence length (see module docstring).
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})

#: Model types whose decoder layers blending drives directly (verified by tests/integrations/test_blend*.py):
#: plain pre-norm layers that attend through ``past_key_values.update`` and take an additive 4-D mask.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class UnsupportedModel(ConfigError):
    """Blending cannot run on this model; prompts get a full prefill instead."""


class Rerotator:
    """Re-rotates canonical keys (``[layers, 2, tokens, kv_heads, head_dim]``) by a position offset.

    Raises UnsupportedModel for a model or RoPE type blending does not support.
    """

    def __init__(self, model) -> None:
        config = model.config.get_text_config(decoder=True)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"model type {config.model_type!r} is not one blending supports "
                                   f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
        layer_types = getattr(config, "layer_types", None) or ()
        if any(kind != "full_attention" for kind in layer_types):
            raise UnsupportedModel("blending needs every layer to use full attention")
        decoder = model.get_decoder()
        self.rotary = getattr(decoder, "rotary_emb", None)
        rope_type = getattr(self.rotary, "rope_type", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(f"RoPE type {rope_type!r} cannot be re-rotated exactly "
                                   f"(supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})")
        self.rope_type: str = rope_type
        self._apply = sys.modules[type(decoder.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def rotation(self, delta: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``(cos, sin)`` of a pure rotation by ``delta`` positions, shaped ``[1, 1, head_dim]``."""
        probe = torch.empty(0, dtype=torch.float32, device=device)
        positions = torch.tensor([[delta]], device=device)
        cos, sin = self.rotary(probe, positions)
        scale = float(getattr(self.rotary, "attention_scaling", 1.0))
        return cos / scale, sin / scale

    def shift(self, kv: torch.Tensor, delta: int, *, inplace: bool = False) -> torch.Tensor:
        """Canonical ``kv`` with its keys ``delta`` positions later (earlier if negative): a copy, or ``kv``
        itself rotated in place."""
        out = kv if inplace else kv.clone()
        if delta == 0:
            return out
        cos, sin = self.rotation(delta, kv.device)
        keys = kv[:, 0].to(torch.float32)  # [layers, tokens, heads, dim]: cos broadcasts over the first three
        rotated, _ = self._apply(keys, keys[:, :1], cos, sin, unsqueeze_dim=1)
        out[:, 0] = rotated.to(kv.dtype)
        return out
