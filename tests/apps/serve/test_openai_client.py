"""kvtier serve through the official ``openai`` client library, as OpenAI-compatible clients and chat UIs use it:
sampled answers (temperature, top_p, top_k, seed, penalties), streaming, errors, cached-token usage."""

from __future__ import annotations

import openai
import pytest

from harness.serve import start_server
from tests.apps.serve.test_http import MESSAGES, SYSTEM


@pytest.fixture
def api(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0, timeout=60) as client:
        yield client


def ask(api: openai.OpenAI, **kwargs):
    return api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, **kwargs)


def test_what_chat_uis_send_is_served(api):
    answer = ask(api, temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.2)
    assert answer.object == "chat.completion" and answer.model == "tiny"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.completion_tokens >= 1


def test_a_seed_reproduces_a_sampled_answer_and_the_second_comes_from_the_cache(api):
    settings = {"temperature": 1.0, "top_p": 0.95, "seed": 42, "extra_body": {"top_k": 40}}
    first, second = ask(api, **settings), ask(api, **settings)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert second.choices[0].message.content == first.choices[0].message.content
    answers = {ask(api, temperature=1.0, seed=s).choices[0].message.content for s in range(4)}
    assert len(answers) > 1  # different seeds, different samples: the seed is what made them equal


def test_streamed_sampled_answer_equals_the_whole_one_with_the_same_seed(api):
    whole = api.completions.create(model="tiny", prompt=SYSTEM, max_tokens=12, temperature=0.9, seed=5)
    parts = api.completions.create(model="tiny", prompt=SYSTEM, max_tokens=12, temperature=0.9, seed=5,
                                   stream=True, stream_options={"include_usage": True})
    chunks = list(parts)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sampling_never_changes_the_cached_prompt(api, tiny_model_dir):
    """A sampled first request stores the prompt; a greedy one then hits it and still answers exactly as a
    server without kvtier does."""
    sampled = ask(api, temperature=1.5, top_p=0.8, seed=3, frequency_penalty=1.0)
    greedy = ask(api)
    assert sampled.usage.prompt_tokens_details.cached_tokens == 0
    assert greedy.usage.prompt_tokens_details.cached_tokens >= 64
    with start_server(tiny_model_dir, cache=False) as plain, openai.OpenAI(
            base_url=f"{plain.url}/v1", api_key="sk-test", max_retries=0, timeout=60) as baseline:
        assert ask(baseline).choices[0].message.content == greedy.choices[0].message.content


@pytest.mark.parametrize("settings,words", [
    ({"n": 2}, "n must be 1"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
])
def test_unservable_settings_are_400s_that_name_them(api, settings, words):
    with pytest.raises(openai.BadRequestError) as err:
        ask(api, **settings)
    assert err.value.status_code == 400
    assert words in err.value.message
