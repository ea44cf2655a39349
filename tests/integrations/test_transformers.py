"""End to end with a real transformers model (a small Llama, random weights from a config)."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier import CacheConfig
from kvtier.integrations.transformers import PrefixCachedLM, kv_spec, model_identity, to_canonical, to_dynamic_cache

CHUNK = 32


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def cached(model):
    config = CacheConfig(chunk_size=CHUNK, tiers=[{"kind": "memory", "capacity_bytes": "32MiB"}])
    return PrefixCachedLM.with_new_cache(model, config)


def prompt(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_spec_and_identity(model):
    spec = kv_spec(model)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (3, 2, 32, torch.float32)
    other = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "rms_norm_eps": 1e-3}))
    assert model_identity(model) != model_identity(other)


def test_canonical_round_trip(model):
    with torch.inference_mode():
        past = model(torch.tensor([prompt(70, 1)]), use_cache=True).past_key_values
    kv = to_canonical(past)
    assert kv.shape == (3, 2, 70, 2, 32)
    assert torch.equal(kv[1, 0, :, 1], past.layers[1].keys[0, 1])  # layer 1, K, head 1
    back = to_dynamic_cache(kv, model)
    for a, b in zip(back.layers, past.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(to_canonical(past, 32, 64), kv[:, :, 32:64])


def test_full_hit_gives_identical_greedy_tokens(model, cached):
    ids = prompt(200, 2)
    reference = PrefixCachedLM(model, None).generate(ids, 24).output_ids
    cold = cached.generate(ids, 24)
    warm = cached.generate(ids, 24)
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == 192  # every full chunk, leaving the last tokens to compute
    assert cold.output_ids == warm.output_ids == reference


def test_partial_hit_gives_identical_greedy_tokens(model, cached):
    doc = prompt(150, 3)
    cached.generate(doc + prompt(10, 4), 4)
    follow_up = doc + prompt(25, 5)
    reference = PrefixCachedLM(model, None).generate(follow_up, 24).output_ids
    warm = cached.generate(follow_up, 24)
    assert warm.cached_tokens == 128  # the 4 full chunks inside the shared 150 tokens
    assert warm.output_ids == reference


def test_prompt_of_exactly_whole_chunks_keeps_one_token_to_compute(model, cached):
    ids = prompt(128, 6)
    first = cached.generate(ids, 8)
    again = cached.generate(ids, 8)
    assert again.cached_tokens == 96  # chunk 4 would leave nothing to compute, so it is not used
    assert again.output_ids == first.output_ids


def test_stop_ids_and_streaming(model, cached):
    ids = prompt(60, 7)
    tokens = list(cached.stream(ids, 16))
    assert len(tokens) == 16
    stopped = cached.generate(ids, 16, stop_ids=[tokens[3]])
    assert stopped.output_ids == tokens[: tokens.index(tokens[3]) + 1]


def test_tenants_do_not_share(model, cached):
    ids = prompt(100, 8)
    cached.generate(ids, 2, salt=b"alice")
    assert cached.generate(ids, 2, salt=b"bob").cached_tokens == 0
    assert cached.generate(ids, 2, salt=b"alice").cached_tokens == 96


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine")
@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_on_a_gpu_a_full_hit_gives_identical_greedy_tokens(model, codec):
    """KV computed on the GPU is stored from there (raw: straight into the pinned tier) and loaded back to it."""
    gpu_model = copy.deepcopy(model).to("cuda")
    config = CacheConfig(chunk_size=CHUNK, tiers=[{"kind": "memory", "capacity_bytes": "32MiB", "codec": codec}])
    cached = PrefixCachedLM.with_new_cache(gpu_model, config)
    ids = prompt(200, 2)
    reference = PrefixCachedLM(gpu_model, None).generate(ids, 24).output_ids
    cold = cached.generate(ids, 24)
    warm = cached.generate(ids, 24)
    assert warm.cached_tokens == 192
    assert cold.output_ids == warm.output_ids == reference


def test_attention_models_get_the_plain_generator_without_importing_the_stateful_one(model):
    """transformers.py finds hybrid.py's generator by name (GENERATORS), so it never imports hybrid.py itself;
    an attention-only model is served without it."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from kvtier.integrations import transformers as t\n"
        "print('kvtier.integrations.hybrid' in sys.modules)\n"
        "m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=1)).eval()\n"
        "print(t.generator_class(m).__name__, type(t.prefix_cached_lm(m, None)).__name__)\n"
        "print('kvtier.integrations.hybrid' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["False", "PrefixCachedLM PrefixCachedLM", "False"]
    from kvtier.integrations.transformers import cache_spec, generator_class

    assert generator_class(model) is PrefixCachedLM and cache_spec(model) == kv_spec(model)
