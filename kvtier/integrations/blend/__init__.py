"""Non-prefix reuse (CacheBlend) for transformers models: prefill.py holds the method, lm.py its use, config.py
its settings. ``BlendConfig`` loads without transformers; the other names load it on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.integrations.blend.config import BlendConfig

_LAZY = {"BlendedLM": "kvtier.integrations.blend.lm", "UnsupportedModel": "kvtier.integrations.blend.rope"}

__all__ = ["BlendConfig", "BlendedLM", "UnsupportedModel"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from kvtier.integrations.blend.lm import BlendedLM
    from kvtier.integrations.blend.rope import UnsupportedModel
