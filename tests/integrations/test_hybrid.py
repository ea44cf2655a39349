"""Prefix caching of SSM and hybrid models end to end: real transformers models (random weights from configs).

Pure Mamba2 and Granite 4's hybrid (GraniteMoeHybrid: Mamba2 layers plus an attention layer) in every test;
Falcon-H1 (attention and Mamba2 side by side in each layer) and Bamba for the exactness cases.
"""

import pytest
import torch
import transformers

from kvtier import CacheConfig
from kvtier.base.errors import ConfigError
from kvtier.base.state import StateKind, state_key
from kvtier.integrations.hybrid import StatefulPrefixCachedLM, probe_layout
from kvtier.integrations.transformers import PrefixCachedLM, cache_spec, generator_class, prefix_cached_lm

CHUNK = 32
VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16)
CONFIGS = {
    "mamba2": lambda: transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=8,
                                                head_dim=16, state_size=16, n_groups=1, expand=2, chunk_size=16),
    "granite-hybrid": lambda: transformers.GraniteMoeHybridConfig(
        **SMALL, **MAMBA, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
        num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=128),
    "falcon-h1": lambda: transformers.FalconH1Config(**SMALL, **MAMBA, num_hidden_layers=2, mamba_d_ssm=128),
    "bamba": lambda: transformers.BambaConfig(**SMALL, **MAMBA, num_hidden_layers=3, attn_layer_indices=[1]),
}
MAIN = ["mamba2", "granite-hybrid"]


def build(name, dtype=torch.float32):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).to(dtype).eval()


@pytest.fixture(scope="module", params=MAIN)
def model(request):
    return build(request.param)


@pytest.fixture(scope="module")
def hybrid():
    return build("granite-hybrid")


def cached_lm(model, snapshots="every", **tier):
    config = CacheConfig(chunk_size=CHUNK, state_snapshots=snapshots,
                         tiers=[{"kind": "memory", "capacity_bytes": "16MiB", "prefault": False, **tier}])
    return PrefixCachedLM.with_new_cache(model, config)


def prompt(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def uncached(model, ids, n=12):
    return StatefulPrefixCachedLM(model, None, chunk_size=CHUNK).generate(ids, n).output_ids


def test_layouts_and_specs():
    mamba = probe_layout(build("mamba2"))
    assert mamba.spec.attention is None and mamba.attention == () and mamba.cache_arg == "cache_params"
    assert [s.kind for s in mamba.spec.states] == [StateKind.CONV, StateKind.SSM]
    conv, ssm = mamba.spec.states
    assert (conv.slots, conv.shape, ssm.shape) == (2, (128 + 2 * 16, 4), (8, 16, 16))
    granite = probe_layout(build("granite-hybrid", torch.bfloat16))
    assert granite.attention == (1,) and granite.slots[StateKind.SSM] == ((0, 0), (2, 0), (3, 0))
    assert granite.spec.attention.num_layers == 1 and granite.spec.attention.dtype == torch.bfloat16
    assert [s.dtype for s in granite.spec.states] == [torch.bfloat16, torch.float32]  # SSM state stays fp32
    assert probe_layout(build("falcon-h1")).attention == (0, 1)  # every layer holds both


def test_models_with_ssm_layers_get_the_stateful_generator(model):
    assert isinstance(cached_lm(model), StatefulPrefixCachedLM)
    assert isinstance(prefix_cached_lm(model, None), StatefulPrefixCachedLM)
    assert generator_class(model) is StatefulPrefixCachedLM  # found by name: transformers.py never imports it
    with pytest.raises(ConfigError, match="SSM layers"):
        PrefixCachedLM(model, None)  # the attention-only path would drop the recurrent state


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_hit_partial_hit_and_short_prompt_give_identical_tokens(name):
    model = build(name)
    lm = cached_lm(model)
    ids = prompt(200, 1)
    reference = uncached(model, ids)
    cold, warm = lm.generate(ids, 12), lm.generate(ids, 12)
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 192)
    assert cold.output_ids == warm.output_ids == reference

    follow_up = ids[:150] + prompt(40, 2)  # shares 4 full chunks and a part of the fifth
    partial = lm.generate(follow_up, 12)
    assert partial.cached_tokens == 128
    assert partial.output_ids == uncached(model, follow_up)

    short = prompt(20, 3)  # shorter than a chunk: nothing to cache, nothing to hit
    assert lm.generate(short, 12).output_ids == lm.generate(short, 12).output_ids == uncached(model, short)


def test_segmented_prefill_matches_one_plain_forward(model):
    """The boundaries every prefill passes through change nothing but rounding: logits as one forward's."""
    ids = prompt(150, 4)
    layout = probe_layout(model)
    with torch.inference_mode():
        plain = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    lm = StatefulPrefixCachedLM(model, None, chunk_size=CHUNK)
    past, _ = lm._cached_prefix(ids, b"", None)
    with torch.inference_mode():
        segmented = lm._prefill_rest(ids, 0, past)
    assert layout.spec.states and torch.allclose(plain, segmented, atol=1e-4, rtol=0)


def test_exact_in_bfloat16():
    model = build("granite-hybrid", torch.bfloat16)
    lm = cached_lm(model)
    ids = prompt(140, 5)
    first, second = lm.generate(ids, 10), lm.generate(ids, 10)
    assert second.cached_tokens == 128 and first.output_ids == second.output_ids == uncached(model, ids, 10)


def test_corrupt_snapshot_is_recomputed_not_used(model):
    lm = cached_lm(model)
    ids = prompt(140, 6)
    reference = lm.generate(ids, 12).output_ids
    tier = lm.cache.tiers[0]
    key = state_key(lm.cache.keys(ids)[3], StateKind.SSM)
    with tier.get([key]) as (blob,):
        blob[40 + 4 * 4] ^= 0xFF  # a token id in the snapshot's header
    again = lm.generate(ids, 12)
    assert again.cached_tokens == 96  # the snapshot at boundary 4 fails; boundary 3's is intact
    assert again.output_ids == reference
    assert lm.cache.metrics.get("kvtier_corrupt_chunks_total", tier="memory") == 1


def test_missing_snapshots_mean_recompute(hybrid):
    lm = cached_lm(hybrid)
    ids = prompt(140, 7)
    reference = lm.generate(ids, 12).output_ids
    keys = lm.cache.keys(ids)
    lm.cache.tiers[0].delete([state_key(k, kind) for k in keys for kind in (StateKind.CONV, StateKind.SSM)])
    again = lm.generate(ids, 12)
    assert again.cached_tokens == 0 and again.output_ids == reference


def test_snapshot_policy_decides_what_is_stored_and_where_prompts_hit(hybrid):
    ids = prompt(200, 8)  # 6 full chunks
    for policy, stored, hit in (("every", 6, 160), ("every-2", 3, 128), ("last", 1, 0), ("last+every-4", 2, 128)):
        lm = cached_lm(hybrid, policy)
        lm.generate(ids, 2)
        assert lm.cache.metrics.get("kvtier_state_snapshots_stored_total", tier="memory") == 2 * stored, policy
        # another prompt sharing 5.6 chunks: it can use boundaries 1..5
        assert lm.generate(ids[:180] + prompt(20, 9), 2).cached_tokens == hit, policy
    longer = ids + prompt(50, 10)  # the next round of a chat: the last policy hits the previous prompt's end
    assert lm.generate(longer, 2).cached_tokens == 192


def test_tenants_do_not_share(hybrid):
    lm = cached_lm(hybrid)
    ids = prompt(100, 11)
    lm.generate(ids, 2, salt=b"alice")
    assert lm.generate(ids, 2, salt=b"bob").cached_tokens == 0
    assert lm.generate(ids, 2, salt=b"alice").cached_tokens == 96


def test_cache_spec_and_lossy_tiers(hybrid):
    spec = cache_spec(hybrid)
    assert spec == probe_layout(hybrid).spec
    with pytest.raises(ConfigError, match="lossy"):
        cached_lm(hybrid, codec="int8")
    lossless = cached_lm(hybrid, codec="lossless")
    ids = prompt(100, 12)
    assert lossless.generate(ids, 8).output_ids == lossless.generate(ids, 8).output_ids == uncached(hybrid, ids, 8)
