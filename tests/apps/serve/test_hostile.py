"""Attacks a hostile client made on the server (issue 17), each over real HTTP against a live uvicorn.

Every one of them used to cost the server something before it was refused: a queued generation, a 500, a
body read whole, or seconds of tokenization on the event loop.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from harness.serve import start_server
from harness.malformed import MALFORMED_JSON
from tests.apps.serve.test_http import MESSAGES, SYSTEM, metric

BAD_STOPS = [["a", "b", "c", "d", "e"], "", [""], ["ok", ""]]


def test_a_bad_stop_is_a_400_before_anything_is_queued(tiny_model_dir):
    with start_server(tiny_model_dir, max_queue=1) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        sent = 0
        for _ in range(3):  # more than the queue holds: each one used to leave a 300-token job behind
            for stop in BAD_STOPS:
                for path, body in (("/v1/completions", {"prompt": "Tell me a long story"}),
                                   ("/v1/chat/completions", {"messages": MESSAGES})):
                    response = c.post(path, json={**body, "max_tokens": 300, "stop": stop})
                    assert response.status_code == 400, response.text
                    error = response.json()["error"]
                    assert "stop" in error["message"] and error["param"] == "stop"
                    sent += 1
        assert c.get("/health").json()["in_flight"] == 0
        assert metric(c, "kvtier_server_requests_total") == sent  # every refusal counted, as a 400
        assert 'endpoint="completions",status="400"' in c.get("/metrics").text
        good = c.post("/v1/completions", json={"prompt": SYSTEM, "max_tokens": 2, "stop": ["zz"]})
        assert good.status_code == 200, good.text


@pytest.mark.parametrize("path,body", MALFORMED_JSON)
def test_every_malformed_body_is_a_400_that_says_so(client, path, body):
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert "not valid JSON" in error["message"] and "line 1 column" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert metric(client, "kvtier_server_requests_total") == 1  # counted, unlike a 500 from a crash


@pytest.mark.parametrize("body,param", [
    ({"prompt": "the cache", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": [1.0, 2.0]}, "prompt"),
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": "the cache", "max_tokens": 3.0}, "max_tokens"),
    ({"prompt": "the cache", "stream": "yes"}, "stream"),
])
def test_types_are_strict_as_in_openais_api(client, body, param):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _exchange(port: int, head: bytes, chunks=()) -> tuple[int, dict]:
    """Send a raw request head and body chunks (never finishing a chunked body), read one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(head)
        for chunk in chunks:
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        data = b""
        while b"\r\n\r\n" not in data:
            more = s.recv(65536)
            assert more, f"the server closed the connection without a response: {data!r}"
            data += more
        head_bytes, body = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head_bytes.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(body) < length:
            body += s.recv(65536)
        return int(head_bytes.split()[1]), json.loads(body)


def test_an_oversized_body_is_a_413_before_it_is_read(server):
    port = server.port
    declared = (b"POST /v1/completions HTTP/1.1\r\nHost: kvtier\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000000\r\n\r\n")
    status, body = _exchange(port, declared)  # not one byte of the 100 MB body is sent
    assert status == 413 and "limit of 8388608 bytes" in body["error"]["message"]
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvtier\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    status, body = _exchange(port, chunked, [b'{"messages": [{"role": "user", "content": "'] + [b"x" * (1 << 20)] * 9)
    assert status == 413  # refused once 8 MiB arrived, though the body never ended
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert 'status="413"' in c.get("/metrics").text


def test_a_huge_prompt_is_refused_after_tokenizing_a_context_worth_off_the_event_loop(server, monkeypatch):
    tokenizer, seen = server.backend.tokenizer, []
    real_encode = tokenizer.encode

    def encode(text, *args, **kwargs):
        seen.append((len(text), threading.current_thread()))
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    huge = "the cache keeps a prefix " * 120_000  # 3 MB, under the body limit; about 600 k tokens
    context = server.backend.context
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for path, body in (("/v1/completions", {"prompt": huge}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})):
            response = c.post(path, json=body)
            assert response.status_code == 400 and "context" in response.json()["error"]["message"]
        assert seen and max(n for n, _ in seen) <= 32 * context  # a bounded prefix, never the whole text
        assert server.thread not in {t for _, t in seen}  # the event loop's thread never tokenized
        fits = c.post("/v1/completions", json={"prompt": SYSTEM, "max_tokens": 2})
        assert fits.status_code == 200
        assert fits.json()["usage"]["prompt_tokens"] == len(real_encode(SYSTEM))


def test_a_chat_of_many_messages_is_refused_after_rendering_only_its_leading_ones(server, monkeypatch):
    tokenizer, rendered = server.backend.tokenizer, []
    real_render = tokenizer.apply_chat_template

    def render(messages, *args, **kwargs):
        rendered.append(len(messages))
        return real_render(messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", render)
    words = " the cache keeps a prefix" * 10  # no more messages than the context has tokens, but far more text
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} of a long chat{words}"}
            for i in range(server.backend.context)]
    with httpx.Client(base_url=server.url, timeout=120) as c:
        response = c.post("/v1/chat/completions", json={"messages": many})
        assert response.status_code == 400 and "context" in response.json()["error"]["message"]
        assert rendered and max(rendered) < len(many) // 4  # the leading messages only, never all of them
        rendered.clear()
        short = [{"role": "user", "content": SYSTEM}]
        fits = c.post("/v1/chat/completions", json={"messages": short, "max_tokens": 2})
        assert fits.status_code == 200 and rendered == [1]  # a chat that fits is rendered once, whole


def test_a_chat_of_more_messages_than_the_context_has_tokens_is_refused_before_it_is_decoded(server, monkeypatch):
    decoded = []
    monkeypatch.setattr("kvtier.apps.serve.app.decode_json", lambda raw: decoded.append(len(raw)))
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(240_000)]
    with httpx.Client(base_url=server.url, timeout=120) as c:
        response = c.post("/v1/chat/completions", json={"messages": many})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and "240,000 messages" in error["message"]
        assert decoded == []  # refused from a count of raw spans: the body was never decoded into objects
