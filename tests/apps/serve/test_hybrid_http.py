"""``kvtier serve`` over real HTTP with a pure Mamba2 and a hybrid (Granite 4 style) model: cached prefixes
give exactly the text of generation without them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.serve import build_tiny_model, start_server

SYSTEM = "the cache keeps a prefix of every prompt so the server answers faster " * 4
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "rivers and music"}]


def hybrid_config(kind: str, vocab: int, eos: int, bos: int):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, eos_token_id=eos, bos_token_id=bos, tie_word_embeddings=False)
    mamba = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16)
    if kind == "mamba2":
        return transformers.Mamba2Config(**common, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
                                         n_groups=1, expand=2, chunk_size=16, initializer_range=0.5)
    return transformers.GraniteMoeHybridConfig(
        **common, **mamba, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, shared_intermediate_size=128, num_local_experts=0,
        num_experts_per_tok=0, max_position_embeddings=1024, initializer_range=0.5)


@pytest.fixture(scope="module", params=["mamba2", "granite-hybrid"])
def model_dir(request, tmp_path_factory) -> Path:
    """The tiny Llama folder (tokenizer with a chat template) with its weights replaced by an SSM model's."""
    import torch
    import transformers

    folder = build_tiny_model(tmp_path_factory.mktemp(request.param))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    config = hybrid_config(request.param, len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id)
    for stale in folder.glob("*.safetensors"):
        stale.unlink()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def client(model_dir) -> Iterator[httpx.Client]:
    with start_server(model_dir) as live, httpx.Client(base_url=live.url, timeout=120) as c:
        yield c


def chat(client: httpx.Client, messages, key: str) -> tuple[str, int]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 12}
    response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["message"]["content"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_full_hit_gives_the_text_of_a_cold_request(client):
    cold, cached_cold = chat(client, FIRST, "full")
    warm, cached_warm = chat(client, FIRST, "full")
    assert cached_cold == 0 and cached_warm >= 64
    assert warm == cold


def test_partial_hit_gives_the_text_of_generation_without_the_cache(client):
    answer, _ = chat(client, FIRST, "alice")
    second = FIRST + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and the weather"}]
    warm, cached = chat(client, second, "alice")  # the first round's prompt is a prefix of this one
    fresh, none = chat(client, second, "bob")  # another tenant: nothing cached for it
    assert cached >= 64 and none == 0
    assert warm == fresh


def test_prompt_shorter_than_a_chunk(client):
    body = {"model": "tiny", "prompt": "rivers", "max_tokens": 8}
    first = client.post("/v1/completions", json=body).json()
    again = client.post("/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens"] < 16
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_blend_refuses_models_with_ssm_layers(model_dir):
    """A passage cached alone has KV but no SSM state to continue from: ``--blend`` says so at start."""
    from kvtier.apps.serve.backend import Backend, ServerConfig
    from kvtier.base.errors import ConfigError
    from kvtier.core.config import CacheConfig
    from kvtier.integrations.blend.config import BlendConfig
    from kvtier.tiers import MemoryTierConfig

    cache = CacheConfig(chunk_size=16, tiers=(MemoryTierConfig(capacity_bytes=4 << 20),))
    config = ServerConfig(model_path=model_dir, served_name="tiny", cache=cache, blend=BlendConfig())
    with pytest.raises(ConfigError, match="blending supports attention-only models.*SSM layers"):
        Backend.from_config(config)
