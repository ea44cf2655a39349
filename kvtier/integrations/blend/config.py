"""``BlendConfig``: how an engine blends cached segments into a prompt. Free of engine and torch imports, so
configuration code (``kvtier serve``'s flags) can build one without loading transformers."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.base.errors import ConfigError


@dataclass(frozen=True)
class BlendConfig:
    """How blending trades quality for time to first token.

    ``recompute_ratio``: share of reused tokens recomputed in the layers after ``check_layer`` (0..1); the
    default is the largest ratio that kept time to first token well below prefix caching's in the RAG benchmark
    (benchmarks/blend_rag.py).
    ``check_layer``: the layer whose K/V deviation picks them (layers up to it compute every token).
    ``max_deviation``: the quality gate; a mean relative deviation above it means a full prefill.
    ``base_position``: the position segments are computed at when cached (part of their key).
    ``pass_tokens``: what one forward pass costs beyond its tokens, counted in tokens, in the bound on the work
    one request can cause (lm.py): a pass over one token is not free. The default is about what this project's
    CPU measurements give for small models (docs/integrations/blend.md); on a GPU a pass costs more tokens.
    """

    recompute_ratio: float = 0.15
    check_layer: int = 1
    max_deviation: float = 0.5
    base_position: int = 0
    pass_tokens: int = 32

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ConfigError(f"recompute_ratio must lie in [0, 1], got {self.recompute_ratio}")
        if self.check_layer < 0:
            raise ConfigError(f"check_layer must be >= 0, got {self.check_layer}")
        if not self.max_deviation >= 0.0:
            raise ConfigError(f"max_deviation must be >= 0, got {self.max_deviation}")
        if self.base_position < 0:
            raise ConfigError(f"base_position must be >= 0, got {self.base_position}")
        if self.pass_tokens < 0:
            raise ConfigError(f"pass_tokens must be >= 0, got {self.pass_tokens}")
