"""Pieces of the server that need no HTTP: text streaming, tenant salts, request validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kvtier.api.errors import RequestError
from kvtier.apps.serve.backend import tenant_salt
from kvtier.apps.serve.protocol import ChatRequest, CompletionRequest, parse
from kvtier.apps.serve.textstream import TextStream
from kvtier.base.errors import ConfigError
from harness.serve import WORDS


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_text_stream_releases_the_decoded_text_in_pieces(tokenizer):
    ids = tokenizer.encode("the cache keeps a prefix of every prompt")
    stream = TextStream(tokenizer)
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert sum(1 for p in pieces if p) > 1


def test_text_stream_holds_back_a_possible_stop_and_cuts_at_it(tokenizer):
    ids = tokenizer.encode("the cache keeps a prefix of every prompt")
    stream = TextStream(tokenizer, stop=["prefix"])
    released = ""
    for t in ids:
        released += stream.push(t)
        assert "pre" not in released or stream.stopped
    released += stream.flush()
    assert stream.stopped and released == "the cache keeps a "


def test_text_stream_skips_end_of_turn_tokens(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stream = TextStream(tokenizer, skip_ids=[end])
    text = "".join(stream.push(t) for t in [*tokenizer.encode("music"), end]) + stream.flush()
    assert text == "music"


def test_tenant_salt_is_per_key_and_empty_without_one():
    assert tenant_salt(None) == tenant_salt("") == b""
    assert tenant_salt("a") != tenant_salt("b")
    assert len(tenant_salt("a")) == 32 and tenant_salt("a") == tenant_salt("a")


def test_requests_accept_openai_shapes():
    req = parse(CompletionRequest, {"prompt": [[1, 2, 3]], "temperature": 0, "top_p": 1, "n": 1})
    assert req.prompt_value() == [1, 2, 3]
    chat = parse(ChatRequest, {"messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}],
                               "max_completion_tokens": 5})
    assert chat.template_messages() == [{"role": "system", "content": "hi"}] and chat.limit() == 5


@pytest.mark.parametrize("body", [{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, {"prompt": "x", "stop": [""]}])
def test_bad_stop_lists_are_refused(body):
    with pytest.raises(RequestError, match="stop"):
        parse(CompletionRequest, body).stop_strings()


def test_serve_binds_loopback_unless_told_and_builds_the_cache_from_flags():
    import argparse

    from kvtier.apps.serve.cli import add_parser, cache_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert args.host == "127.0.0.1"
    config = cache_config(parser.parse_args(["serve", "--chunk-size", "64", "--memory-bytes", "8MiB"]))
    assert config.chunk_size == 64 and config.tiers[0].capacity_bytes == 8 << 20
    assert cache_config(parser.parse_args(["serve", "--no-cache"])) is None


def test_serve_and_route_take_the_same_http_limit_flags_with_the_same_defaults():
    import argparse

    from kvtier.apps.route.cli import add_parser as add_route
    from kvtier.apps.route.cli import router_config
    from kvtier.apps.serve.cli import add_parser as add_serve
    from kvtier.web.http_limits import HttpLimits, http_limits

    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    add_serve(commands), add_route(commands)
    flags = ["--max-head-bytes", "8KiB", "--max-headers", "7", "--head-timeout", "0.5", "--body-timeout", "2",
             "--max-connections", "9"]
    wanted = HttpLimits(max_head_bytes=8 << 10, max_headers=7, head_timeout_s=0.5, body_timeout_s=2.0,
                        max_connections=9)
    assert http_limits(parser.parse_args(["serve", *flags])) == wanted
    assert router_config(parser.parse_args(["route", "--replica", "http://r:1", *flags])).http == wanted
    assert http_limits(parser.parse_args(["serve"])) == HttpLimits()
    assert router_config(parser.parse_args(["route", "--replica", "http://r:1"])).http == HttpLimits()
    with pytest.raises(ConfigError, match="positive"):
        http_limits(parser.parse_args(["serve", "--head-timeout", "0"]))


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS + ["  ", "\n", "é", "zq"]), min_size=1, max_size=400),
       context=st.integers(4, 120))
def test_bounded_encoding_is_exact_when_it_fits_and_refuses_only_what_cannot(tokenizer, words, context):
    from kvtier.apps.serve import prompt_limits as prompts

    text = " ".join(words)
    whole = tokenizer.encode(text)
    try:
        ids = prompts.encode_within(tokenizer.encode, text, context)
    except RequestError as exc:
        assert len(whole) > context and "context" in str(exc)
    else:
        assert ids == whole and len(ids) <= context + prompts.CUT_MARGIN


def test_bounded_encoding_reads_a_bounded_prefix_of_a_huge_text(tokenizer):
    from kvtier.apps.serve import prompt_limits as prompts

    lengths = []

    def encode(text):
        lengths.append(len(text))
        return tokenizer.encode(text)

    with pytest.raises(RequestError, match="more than"):
        prompts.encode_within(encode, "rivers and music " * 100_000, 100)
    assert max(lengths) <= 100 * prompts.FIRST_WINDOW_CHARS_PER_TOKEN * 4
