"""``kvtier serve`` serves text only, over real HTTP: any other content part, and prompt embeddings, are a 400 in
the server's usual error envelope that names what was refused; nothing is generated or cached for them, and the
server serves on."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.apps.serve.test_http import MESSAGES, chat, metric

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
PARTS = [
    IMAGE,
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}},
    {"type": "audio_url", "audio_url": {"url": "https://example.invalid/a.wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
    {"type": "image_embeds", "image_embeds": "AAAA"},
]
EMBEDS = base64.b64encode(bytes(64)).decode()


def refused(response: httpx.Response, param: str, words: str) -> None:
    """The usual 400 envelope (the shape every other 400 of the server has)."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["param"] == param
    assert "serves text only" in error["message"] and words in error["message"]


@pytest.mark.parametrize("part", PARTS, ids=[p["type"] for p in PARTS])
def test_a_non_text_content_part_is_a_400_naming_it(client, part):
    messages = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4})
    refused(response, "messages", f"messages[1].content[1] is a '{part['type']}' part")


def test_prompt_embeddings_are_a_400_on_both_endpoints(client):
    refused(client.post("/v1/completions", json={"model": "tiny", "prompt_embeds": EMBEDS, "max_tokens": 4}),
            "prompt_embeds", "prompt_embeds (prompt embeddings) is not supported")
    refused(client.post("/v1/completions", json={"prompt": "the", "prompt_embeds": [EMBEDS], "max_tokens": 4}),
            "prompt_embeds", "prompt embeddings")
    refused(client.post("/v1/chat/completions", json={"messages": MESSAGES, "prompt_embeds": EMBEDS}),
            "prompt_embeds", "prompt embeddings")


def test_refused_inputs_cost_nothing_and_text_is_served_as_before(client):
    """No prompt tokens counted or stored for the refused requests; the same text afterwards is a cold miss,
    then a hit, exactly as without them."""
    for part in PARTS:
        body = {"messages": [*MESSAGES[:1], {"role": "user", "content": [part]}], "max_tokens": 4}
        assert client.post("/v1/chat/completions", json=body).status_code == 400
    assert metric(client, "kvtier_server_prompt_tokens_total") == 0
    first, second = chat(client), chat(client)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    assert metric(client, "kvtier_server_requests_total") >= len(PARTS) + 2
