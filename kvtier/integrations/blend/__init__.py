"""Non-prefix reuse (CacheBlend) for transformers models: prefill.py holds the method, lm.py its use, config.py
its settings. ``BlendConfig`` loads without transformers; the other names load it on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.base.registry import lazy_exports
from kvtier.integrations.blend.config import BlendConfig

_LAZY = {"BlendedLM": "kvtier.integrations.blend.lm", "UnsupportedModel": "kvtier.integrations.blend.rope"}

__all__ = ["BlendConfig", "BlendedLM", "UnsupportedModel"]


__getattr__ = lazy_exports(__name__, globals(), _LAZY)

if TYPE_CHECKING:
    from kvtier.integrations.blend.lm import BlendedLM
    from kvtier.integrations.blend.rope import UnsupportedModel
