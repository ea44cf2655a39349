"""Sampling: greedy stays exact, seeds reproduce answers, filters and penalties do what OpenAI and vLLM say,
and no sampling setting changes the prompt KV that PrefixCachedLM stores."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier import CacheConfig
from kvtier.base.errors import ConfigError
from kvtier.integrations.sampling import GREEDY, Sampler, SamplingParams
from kvtier.integrations.transformers import PrefixCachedLM

CHUNK = 16
VOCAB = 256


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def new_lm(model) -> PrefixCachedLM:
    config = CacheConfig(chunk_size=CHUNK, tiers=[{"kind": "memory", "capacity_bytes": "8MiB"}])
    return PrefixCachedLM.with_new_cache(model, config)


def prompt(n: int = 70, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    """``n`` independent single-token choices (a fresh sampler each, so penalties never build up)."""
    return [Sampler(SamplingParams(**{**params.__dict__, "seed": i})).choose(logits) for i in range(n)]


def test_default_is_argmax_of_the_logits():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    assert Sampler().choose(logits) == int(logits.argmax())
    assert Sampler(SamplingParams(temperature=1e-7)).choose(logits) == int(logits.argmax())  # too cold to sample
    assert set(draws(SamplingParams(temperature=1.5, top_k=1), logits, 20)) == {int(logits.argmax())}
    assert set(draws(SamplingParams(temperature=1.5, top_p=1e-6), logits, 20)) == {int(logits.argmax())}


def test_top_k_and_top_p_keep_only_their_tokens():
    logits = torch.tensor([4.0, 3.9, 3.8, 0.0, -1.0, -2.0])
    assert set(draws(SamplingParams(temperature=1.0, top_k=2), logits, 200)) == {0, 1}
    probs = torch.softmax(logits, 0)
    # the nucleus for top_p just above p0 + p1 is exactly {0, 1, 2}
    nucleus = float(probs[0] + probs[1]) + 1e-3
    assert set(draws(SamplingParams(temperature=1.0, top_p=nucleus), logits, 300)) == {0, 1, 2}


def test_sampled_frequencies_follow_the_softmax_at_the_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    picks = draws(SamplingParams(temperature=0.5), logits, 2000)
    expected = torch.softmax(logits / 0.5, 0)
    observed = torch.bincount(torch.tensor(picks), minlength=4).float() / len(picks)
    assert torch.allclose(observed, expected, atol=0.03), (observed, expected)


def test_penalties_lower_tokens_already_generated():
    logits = torch.tensor([1.0, 0.5, 0.0])
    plain = Sampler()
    assert [plain.choose(logits) for _ in range(3)] == [0, 0, 0]
    presence = Sampler(SamplingParams(presence_penalty=1.2))  # greedy; the same penalty once a token appeared
    assert [presence.choose(logits) for _ in range(4)] == [0, 1, 2, 0]
    frequency = Sampler(SamplingParams(frequency_penalty=0.3))  # grows with each repeat
    assert [frequency.choose(logits) for _ in range(4)] == [0, 0, 1, 0]


@pytest.mark.parametrize("bad", [{"temperature": -0.1}, {"temperature": 2.5}, {"top_p": 0.0}, {"top_p": 1.2},
                                 {"top_k": 0}, {"presence_penalty": 3.0}, {"frequency_penalty": -2.5},
                                 {"seed": 2**64}])
def test_out_of_range_settings_are_config_errors(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_a_seed_reproduces_a_sampled_answer_cold_and_warm(model):
    lm = new_lm(model)
    tokens = prompt()
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    cold = lm.generate(tokens, 24, sampling=params)
    warm = lm.generate(tokens, 24, sampling=params)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 64
    assert warm.output_ids == cold.output_ids
    others = {tuple(lm.generate(tokens, 24, sampling=SamplingParams(temperature=1.0, seed=s)).output_ids)
              for s in range(4)}
    assert len(others) > 1  # the seed is what makes them equal, not a lack of randomness


def test_greedy_is_exact_with_and_without_the_cache(model):
    tokens = prompt(seed=2)
    plain = PrefixCachedLM(model, None).generate(tokens, 16, sampling=GREEDY).output_ids
    lm = new_lm(model)
    assert lm.generate(tokens, 16).output_ids == plain
    warm = lm.generate(tokens, 16)
    assert warm.cached_tokens == 64 and warm.output_ids == plain


def test_sampling_never_changes_what_is_cached(model):
    tokens = prompt(seed=3)
    greedy_lm, sampled_lm = new_lm(model), new_lm(model)
    greedy_lm.generate(tokens, 8)
    sampled_lm.generate(tokens, 8, sampling=SamplingParams(temperature=1.3, top_k=50, presence_penalty=1.0,
                                                           frequency_penalty=0.5, seed=7))
    assert sampled_lm.cache.lookup(tokens) == greedy_lm.cache.lookup(tokens) == 64
    kv_greedy, n_greedy = greedy_lm.cache.retrieve(tokens)
    kv_sampled, n_sampled = sampled_lm.cache.retrieve(tokens)
    assert n_greedy == n_sampled == 64
    assert torch.equal(kv_greedy[:, :, :64], kv_sampled[:, :, :64])
