"""``kvtier serve``'s checks of chat messages (kvtier.apps.serve.protocol), unit-level.

Issue 29, R-2 on a replica: messages are checked by msgspec instead of one pydantic model each (a chat of 250k
messages, what 8 MiB holds, held the GIL for a second in pydantic's one call, stalling /health); these pin
what is accepted and refused, and that a 400 names ``messages``.
"""

from __future__ import annotations

import pytest

from kvtier.api.errors import RequestError
from kvtier.apps.serve.protocol import ChatRequest, parse


@pytest.mark.parametrize("messages", [
    [], "hi", [{"role": "bot", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": 3}],
    [{"role": "user", "content": "x", "extra": 1}], [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"role": "user", "content": [{"type": "text", "text": "x", "more": 1}]}], [{"role": "user", "content": None}],
])
def test_messages_no_template_could_render_are_a_400_naming_messages(messages):
    with pytest.raises(RequestError) as refused:
        parse(ChatRequest, {"messages": messages})
    assert refused.value.status == 400 and refused.value.param == "messages"


def test_messages_are_rendered_as_before():
    request = parse(ChatRequest, {"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi", "name": "ann"}], "max_completion_tokens": 3})
    assert request.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert request.limit() == 3


def test_a_chat_as_long_as_the_body_cap_allows_is_checked_whole():
    messages = [{"role": "user", "content": "hi"}] * 200_000
    assert len(parse(ChatRequest, {"messages": messages}).template_messages()) == 200_000
    with pytest.raises(RequestError) as refused:
        parse(ChatRequest, {"messages": messages + [{"role": "user", "content": 1}]})
    assert refused.value.param == "messages" and "messages[200000]" in str(refused.value)
