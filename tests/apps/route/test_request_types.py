"""The router's strict type checks of request bodies (kvtier.apps.route.requests), unit-level.

Issue 29, R-2: the checks moved from pydantic models to msgspec (a chat of 250k messages held the GIL for a
second in pydantic's one call, stalling the event loop); these pin that what is accepted and refused, and the
field a 400 names, did not change.
"""

from __future__ import annotations

import json

import pytest

from kvtier.api.errors import RequestError
from kvtier.apps.route.requests import PREFIX_BYTES, TOKEN_ID_LIMIT, WHOLE_BODY_BYTES, parse_request
from kvtier.tiers.control import MAX_TTL_S

REFUSED = [
    (False, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (False, {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    (False, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (False, {"prompt": "x", "stream": 1}, "stream"),
    (False, {"prompt": "x", "user": 7}, "user"),
    (False, {"prompt": 3}, "prompt"),
    (False, {"prompt": [1.0]}, "prompt"),
    (False, {"prompt": [True]}, "prompt"),
    (False, {"prompt": [1, "a"]}, "prompt"),
    (False, {"prompt": [[1], "a"]}, "prompt"),
    (False, {"prompt": []}, "prompt"),
    (False, {"prompt": [TOKEN_ID_LIMIT]}, "prompt"),
    (False, {"prompt": [-1]}, "prompt"),
    (False, {}, "prompt"),
    (False, {"prompt": "x", "cache_ttl_s": 1e308}, "cache_ttl_s"),  # what kvtier serve refuses too
    (False, {"prompt": "x", "cache_ttl_s": MAX_TTL_S + 1}, "cache_ttl_s"),
    (False, {"prompt": "x", "cache_ttl_s": -1}, "cache_ttl_s"),
    (True, {"messages": [{"role": "user", "content": "x"}], "cache_ttl_s": "60"}, "cache_ttl_s"),
    (True, {"messages": []}, "messages"),
    (True, {"messages": [{"role": 3}]}, "messages"),
    (True, {"messages": [{"content": "hi"}]}, "messages"),
    (True, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (True, {"messages": "hi"}, "messages"),
]


@pytest.mark.parametrize(("chat", "body", "param"), REFUSED)
def test_bodies_no_replica_could_serve_are_a_400_naming_the_field(chat, body, param):
    with pytest.raises(RequestError) as refused:
        parse_request(json.dumps(body).encode(), chat, {})
    assert refused.value.status == 400 and refused.value.param == param


def test_what_routing_needs_is_read_and_unknown_fields_are_left_to_the_replica():
    ids = parse_request(json.dumps({"prompt": [[1, 2], [3]], "top_k": 5}).encode(), False, {})
    assert ids.prompt.ids == [1, 2] and not ids.stream and ids.session is None
    texts = parse_request(json.dumps({"prompt": ["a", "b"], "stream": True, "user": "u"}).encode(), False, {})
    assert texts.prompt.text == "a" and texts.stream and texts.session is not None
    chat = parse_request(json.dumps({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": None, "name": "x"}]}).encode(), True, {})
    assert chat.prompt.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": ""}]
    image = parse_request(json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
                          True, {})
    assert image.prompt.messages is None and image.prompt.text is None and image.prompt.ids is None


def test_a_chat_as_long_as_the_body_cap_allows_is_decoded_only_as_far_as_routing_needs():
    """Issue 29, R-2: decoding 200k messages held the GIL ~100 ms in one call. Only those in the first
    PREFIX_BYTES are decoded and checked; the rest (a bad message at the end included) is the replica's."""
    messages = [{"role": "user", "content": "hi"}] * 200_000  # about 6.5 MB, under the 8 MiB cap
    parsed = parse_request(json.dumps({"messages": messages}).encode(), True, {})
    assert parsed.prompt.cut and parsed.prompt.messages[0] == {"role": "user", "content": "hi"}
    assert 1_000 < len(parsed.prompt.messages) <= PREFIX_BYTES // 30 < 200_000
    late = parse_request(json.dumps({"messages": messages + [{"role": None}]}).encode(), True, {})
    assert len(late.prompt.messages) == len(parsed.prompt.messages)
    with pytest.raises(RequestError) as refused:  # within the decoded part: still the router's 400
        parse_request(json.dumps({"messages": [{"role": None}] + messages}).encode(), True, {})
    assert refused.value.param == "messages"


@pytest.mark.parametrize(("body", "param"), [
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": 1, "pad": "' + b"x" * WHOLE_BODY_BYTES + b'"}',
     "stream"),
    (b"[" + b'{"role": "user", "content": "hi"}, ' * 40_000 + b"{}]", None),
    (b'{"messages": [' + b'{"role": "user", "content": "hi"}, ' * 40_000 + b"{}]", None),  # cut short
    (b'{"messages": [' + b'{"role": "user", "content": "hi"}, ' * 40_000 + b"{}], }", None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\ud800", "pad": "' +
     b"x" * WHOLE_BODY_BYTES + b'"}', None),
])
def test_a_large_body_is_still_refused_for_what_the_router_reads(body, param):
    assert len(body) > WHOLE_BODY_BYTES
    with pytest.raises(RequestError) as refused:
        parse_request(body, True, {})
    assert refused.value.status == 400 and refused.value.param == param


def test_a_long_first_element_is_decoded_whole():
    text = "word " * 400_000  # 2 MB in one message: one value, cheap to decode whole
    parsed = parse_request(json.dumps({"messages": [{"role": "user", "content": text}]}).encode(), True, {})
    assert parsed.prompt.messages == [{"role": "user", "content": text}] and not parsed.prompt.cut
    ids = parse_request(json.dumps({"prompt": list(range(500_000))}).encode(), False, {})
    assert ids.prompt.ids == list(range(len(ids.prompt.ids))) and 50_000 < len(ids.prompt.ids) < 500_000


def test_a_body_under_the_threshold_is_decoded_whole_as_before():
    messages = [{"role": "user", "content": "hi"}] * 20_000  # 0.7 MB
    parsed = parse_request(json.dumps({"messages": messages}).encode(), True, {})
    assert len(parsed.prompt.messages) == 20_000 and not parsed.prompt.cut


@pytest.mark.parametrize("body", [
    {"prompt_embeds": "AAAA"}, {"prompt": "the cache", "prompt_embeds": ["AAAA"]},
    {"prompt": "the cache", "cache_salt": "s"}, {"prompt": [1, 2, 3], "cache_salt": "s"},
])
def test_a_completion_whose_kv_is_more_than_its_tokens_is_routed_unscored(body):
    """Prompt embeddings or a cache salt: not scored as the text or ids beside them (replicas' blocks for such
    prompts carry extra keys and are never indexed), and a prompt of embeddings alone is accepted."""
    prompt = parse_request(json.dumps(body).encode(), False, {}).prompt
    assert prompt.messages is None and prompt.text is None and prompt.ids is None


def test_a_chat_with_a_cache_salt_or_an_image_is_routed_unscored():
    text = [{"role": "user", "content": "hi"}]
    image = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                          {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert parse_request(json.dumps({"messages": text}).encode(), True, {}).prompt.messages == text
    for body in ({"messages": text, "cache_salt": "s"}, {"messages": image}):
        assert parse_request(json.dumps(body).encode(), True, {}).prompt.messages is None
