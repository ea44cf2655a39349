"""How the next token is chosen from a model's logits: greedy by default, or OpenAI-style sampling.

``SamplingParams()`` is greedy decoding (argmax), exact and deterministic, so outputs with and without the
cache compare token for token. A temperature above 0 samples, after optional top-k and top-p (nucleus)
filtering; presence and frequency penalties follow OpenAI's definition (they lower the logits of tokens
already generated in this answer) and apply to greedy decoding too. A ``seed`` makes a sampled answer
reproducible: each generation draws from its own ``torch.Generator``, never from torch's global one.

A sampler only reads logits: it never touches the model's KV, so what a request stores in kvtier (its
prompt's KV) does not depend on how its answer was chosen.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from kvtier.base.errors import ConfigError

#: torch.Generator.manual_seed accepts exactly this range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
#: Temperatures below this decode greedily: dividing logits by less overflows float32 (vLLM does the same).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` None keeps every token; ``seed`` None draws a fresh seed."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ConfigError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be at least 1 (or None for no limit), got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ConfigError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


GREEDY = SamplingParams()


class Sampler:
    """Chooses the tokens of one generation. Holds that generation's RNG and the counts of its tokens."""

    def __init__(self, params: SamplingParams = GREEDY) -> None:
        self.params = params
        self._seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator: torch.Generator | None = None
        self._counts: torch.Tensor | None = None  # per vocabulary entry: times generated so far

    def choose(self, logits: torch.Tensor) -> int:
        """The next token given the last position's logits (``[vocab]``); records it for the penalties."""
        p = self.params
        if p.penalized:
            logits = self._penalize(logits.float())
        if p.greedy:
            token = int(logits.argmax())
        else:
            token = self._sample(logits.float())
        if self._counts is not None:
            self._counts[token] += 1
        return token

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros_like(logits)
            return logits
        p = self.params
        return logits - p.frequency_penalty * self._counts - p.presence_penalty * (self._counts > 0).float()

    def _sample(self, logits: torch.Tensor) -> int:
        p = self.params
        logits = logits / p.temperature
        if p.top_k is not None and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set of most likely tokens whose mass reaches top_p (the first always stays)
            outside = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(outside, 0.0))
        return int(torch.multinomial(probs, 1, generator=self._rng(probs.device)))

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self._seed)
        return self._generator
