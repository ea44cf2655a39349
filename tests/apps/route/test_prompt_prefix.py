"""The router tokenizes a chat's leading messages only (kvtier.integrations.prompts, issue 29 R-2).

Rendering the chat template over all 240k messages of a 7.9 MB chat, to tokenize a bounded prefix of the text,
held the router's GIL for most of its CPU. These pin that the messages rendered are bounded by the token limit,
not by the chat, that the ids are still the leading ids of the whole chat, and that a normal chat's ids (its
chunk keys, hence its routing) are exactly what they were: the whole template with the generation prompt.
"""

from __future__ import annotations

import pytest

from kvtier.integrations.prompts import PromptTokenizer
from kvtier.integrations.tokenize import CUT_MARGIN, FIRST_WINDOW_CHARS_PER_TOKEN
from harness.serve import WORDS, build_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    return PromptTokenizer(build_tiny_model(tmp_path_factory.mktemp("prompt-prefix") / "model"))


def whole(tokenizer: PromptTokenizer, messages: list[dict[str, str]]) -> list[int]:
    raw = tokenizer._tokenizer
    return raw.encode(raw.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def test_a_normal_chat_is_rendered_whole_with_the_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " ".join(WORDS)},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and the rivers?"}]
    assert tokenizer.chat(messages, 131_072) == whole(tokenizer, messages) == tokenizer.chat(messages)


def test_a_huge_chat_renders_only_the_messages_its_leading_ids_can_come_from(tokenizer):
    messages = [{"role": "user", "content": f"{WORDS[i % len(WORDS)]} hi"} for i in range(240_000)]
    limit = 512
    before = tokenizer.rendered
    ids = tokenizer.chat(messages, limit)
    rendered = tokenizer.rendered - before
    # the leading messages holding limit x FIRST_WINDOW_CHARS_PER_TOKEN characters, twice (the prefix check)
    assert 0 < rendered <= 2 * limit * FIRST_WINDOW_CHARS_PER_TOKEN // 8 + 2
    assert len(ids) >= limit and ids == whole(tokenizer, messages[:5_000])[: len(ids)]


def test_a_chat_cut_by_the_parser_gives_the_ids_of_its_text_less_the_margin(tokenizer):
    messages = [{"role": "user", "content": " ".join(WORDS)}] * 30
    ids = tokenizer.chat(messages, None, cut=True)
    full = whole(tokenizer, messages + [{"role": "user", "content": "more"}])
    raw = tokenizer._tokenizer
    text = raw.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert ids == full[: len(ids)] and len(ids) == len(raw.encode(text, add_special_tokens=False)) - CUT_MARGIN


def test_a_template_that_does_not_render_a_prefix_of_messages_as_a_prefix_gets_none(tokenizer, monkeypatch):
    raw = tokenizer._tokenizer
    monkeypatch.setattr(raw, "chat_template", "{{ messages | length }}{% for m in messages %}{{ m['content'] }}"
                                              "{% endfor %}")
    messages = [{"role": "user", "content": "hi there"}] * 200_000
    assert tokenizer.chat(messages, 64) is None
    assert tokenizer.chat(messages[:3], 64) == raw.encode("3" + "hi there" * 3, add_special_tokens=False)
