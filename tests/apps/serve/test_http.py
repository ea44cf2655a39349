"""The server over real HTTP: a uvicorn on a free loopback port, a tiny random-weights Llama behind it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoTokenizer

from harness.serve import start_server

SYSTEM = "the cache keeps a prefix of every prompt so the server answers faster " * 4
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "rivers and music"}]


def chat(client: httpx.Client, key: str | None = None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, **extra}
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def stream(client: httpx.Client, path: str, body: dict) -> tuple[str, list[dict]]:
    """Concatenated text deltas and every parsed SSE payload, checking the stream ends with [DONE]."""
    payloads, text, done = [], "", False
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            payload = json.loads(data)
            payloads.append(payload)
            for choice in payload["choices"]:
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    assert done
    return text, payloads


def test_health_and_models(client):
    assert client.get("/health").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_chat_applies_the_template(client, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    via_chat = chat(client)
    assert via_chat["usage"]["prompt_tokens"] == len(ids)
    # the same token ids sent raw to /v1/completions give the same greedy text
    raw = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12}).json()
    assert raw["choices"][0]["text"] == via_chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10}),
    ("/v1/completions", {"prompt": SYSTEM, "max_tokens": 10}),
])
def test_streaming_matches_non_streaming(client, path, body):
    whole = client.post(path, json=body).json()
    text, payloads = stream(client, path, body)
    choice = whole["choices"][0]
    assert text == (choice["message"]["content"] if "message" in choice else choice["text"])
    finishes = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
    assert finishes == [choice["finish_reason"]]
    usage = payloads[-1]["usage"]
    assert payloads[-1]["choices"] == []
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the non-streaming call stored the prompt


def test_greedy_output_identical_cold_warm_and_without_cache(client, tiny_model_dir):
    cold = chat(client)
    warm = chat(client)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    with start_server(tiny_model_dir, cache=False) as plain, httpx.Client(base_url=plain.url, timeout=60) as c:
        baseline = chat(c)
        again = chat(c)
    assert baseline["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_stop_strings_end_the_text(client):
    full = client.post("/v1/completions", json={"prompt": SYSTEM, "max_tokens": 12}).json()["choices"][0]["text"]
    stop = full[3:6]
    assert stop.strip("\ufffd")
    cut = client.post("/v1/completions", json={"prompt": SYSTEM, "max_tokens": 12, "stop": stop}).json()
    assert cut["choices"][0]["text"] == full[: full.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    streamed, _ = stream(client, "/v1/completions", {"prompt": SYSTEM, "max_tokens": 12, "stop": [stop]})
    assert streamed == full[: full.find(stop)]


MALFORMED = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": MESSAGES, "temperature": 2.1}, 400, "temperature"),
    ({"messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
    ({"messages": MESSAGES, "n": 2}, 400, "n must be 1"),
    ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 5000}, 400, "does not fit"),
    ({"messages": MESSAGES, "logprobs": True}, 400, "unsupported field"),
    ({"messages": MESSAGES, "model": "gpt-4"}, 404, "not served here"),
    ({"messages": [{"role": "user", "content": "the cache " * 600}]}, 400, "context"),
    ([1, 2, 3], 400, "JSON object"),
]


@pytest.mark.parametrize("body,status,words", MALFORMED)
def test_malformed_chat_requests_get_4xx(client, body, status, words):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == status
    assert words in response.json()["error"]["message"]


def test_malformed_completion_requests_get_4xx(client):
    cases = [
        (b"{not json", "not valid JSON"),
        (json.dumps({"prompt": [1, 2, 10**6]}).encode(), "outside the vocabulary"),
        (json.dumps({"prompt": ["a", "b"]}).encode(), "batched prompts"),
        (json.dumps({"prompt": ""}).encode(), "must not be empty"),
        (json.dumps({"max_tokens": 3}).encode(), "prompt"),
    ]
    for body, words in cases:
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, body
        assert words in response.json()["error"]["message"], response.text
    bad_auth = client.post("/v1/completions", json={"prompt": "the"}, headers={"Authorization": "Basic abc"})
    assert bad_auth.status_code == 401


def metric(client: httpx.Client, name: str) -> float:
    """Sum of a metric's samples whose name (without labels) is exactly ``name``."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        if series.split("{")[0] == name:
            total += float(value)
    return total


def test_api_keys_never_share_cache_hits(client):
    first_a = chat(client, key="tenant-a")
    hits_before = metric(client, "kvtier_hit_tokens_total")
    first_b = chat(client, key="tenant-b")
    assert metric(client, "kvtier_hit_tokens_total") == hits_before  # b found nothing of a's
    anonymous = chat(client)
    second_a = chat(client, key="tenant-a")
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first_a, first_b, anonymous)] == [0, 0, 0]
    assert second_a["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert metric(client, "kvtier_hit_tokens_total") == hits_before + second_a["usage"]["prompt_tokens_details"][
        "cached_tokens"]
    # the body cannot choose a tenant
    spoof = client.post("/v1/chat/completions", json={"messages": MESSAGES, "user": "tenant-a", "max_tokens": 4})
    assert spoof.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # anonymous tenant's own entry


def test_metrics_counters_move(client):
    assert "# TYPE kvtier_server_requests_total counter" not in client.get("/metrics").text
    chat(client)
    chat(client)
    client.post("/v1/chat/completions", json={"messages": []})
    text = client.get("/metrics").text
    assert 'kvtier_server_requests_total{endpoint="chat",status="200"} 2.0' in text
    assert 'kvtier_server_requests_total{endpoint="chat",status="400"} 1.0' in text
    assert metric(client, "kvtier_server_cached_prompt_tokens_total") >= 64
    assert metric(client, "kvtier_server_generation_tokens_total") == 24
    assert metric(client, "kvtier_stored_tokens_total") > 0


def test_overload_gets_429_at_once_and_recovers(tiny_model_dir):
    with start_server(tiny_model_dir, max_queue=1) as live, httpx.Client(base_url=live.url, timeout=120) as c:
        body = {"prompt": SYSTEM, "max_tokens": 300}

        def post(i: int) -> httpx.Response:
            return c.post("/v1/completions", json={**body, "prompt": f"{i} {SYSTEM}"})

        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(post, range(8)))
        codes = sorted(r.status_code for r in responses)
        assert codes.count(429) >= 1 and set(codes) <= {200, 429}
        assert codes.count(200) >= 1
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert "overloaded" in refused.json()["error"]["message"]
        assert metric(c, "kvtier_server_rejected_total") == codes.count(429)
        after = c.post("/v1/completions", json={"prompt": SYSTEM, "max_tokens": 2})
        assert after.status_code == 200
