"""Non-prefix reuse (CacheBlend) for transformers models: prefill.py holds the method, lm.py its use."""

from kvtier.core.segments import BlendConfig
from kvtier.integrations.blend.lm import BlendedLM
from kvtier.integrations.blend.rope import UnsupportedModel

__all__ = ["BlendConfig", "BlendedLM", "UnsupportedModel"]
