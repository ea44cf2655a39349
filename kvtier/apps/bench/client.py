"""One streamed request against an OpenAI-compatible endpoint, timed on the client.

TTFT is the time from sending the request to the first chunk carrying generated text (a chat stream's
opening role-only chunk does not count). ``stream_options.include_usage`` asks for the usage chunk, from
which ``cached_tokens`` (OpenAI's ``usage.prompt_tokens_details.cached_tokens``) is read when the server
reports it (kvtier serve does; vLLM does with ``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class Target:
    """An endpoint under test: ``label`` names it in tables and plots."""

    label: str
    url: str
    api_key: str | None = None

    @classmethod
    def parse(cls, spec: str, api_key: str | None = None) -> Target:
        """``"label=http://host:port"`` or a bare URL (labelled by its host:port)."""
        label, sep, url = spec.partition("=")
        if not sep:
            label, url = spec.removeprefix("http://").removeprefix("https://").rstrip("/"), spec
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"not an http(s) URL: {url!r}")
        return cls(label, url.rstrip("/"), api_key)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """What one request did. ``ttft_s`` and ``e2e_s`` are None when it failed (``status`` != 200)."""

    target: str
    workload: str
    round: int
    user: int
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    sent_at: float = 0.0  #: seconds since the run started
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""
    error: str = ""
    #: the replica that served it, when a kvtier route in front named it (its ``x-kvtier-replica`` header), and
    #: the number of the router's decision that placed it (``x-kvtier-decision``: the order the router saw)
    replica: str | None = None
    decision: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def send(client: httpx.AsyncClient, target: Target, path: str, body: dict[str, Any],
               result: RequestResult, t0: float) -> RequestResult:
    """POST ``body`` (streaming) to ``target`` + ``path`` and fill in ``result``."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result.sent_at = start - t0
    pieces: list[str] = []
    try:
        # the conversation as a header too: routers that keep sessions read one (vllm-router reads no ``user``)
        session = {"X-Session-ID": body["user"]} if isinstance(body.get("user"), str) else {}
        async with client.stream("POST", target.url + path, json=body,
                                 headers={**target.headers(), **session}) as response:
            result.status = response.status_code
            result.replica = response.headers.get("x-kvtier-replica")
            decision = response.headers.get("x-kvtier-decision", "")
            result.decision = int(decision) if decision.isdigit() else None
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:500]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    result.error = json.dumps(payload["error"])[:500]
                    continue
                text = _text(payload)
                if text and result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - start
                pieces.append(text)
                if payload.get("usage"):
                    _usage(result, payload["usage"])
    except httpx.HTTPError as exc:
        result.status, result.error = result.status or 599, f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - start
    if result.ttft_s is None and not result.error:  # finished without any text (e.g. an immediate stop)
        result.ttft_s = result.e2e_s
    result.text = "".join(pieces)
    return result


def _text(payload: dict[str, Any]) -> str:
    out = ""
    for choice in payload.get("choices") or []:
        out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


def _usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")


async def served_model(client: httpx.AsyncClient, target: Target) -> str:
    """The first model id the endpoint lists."""
    response = await client.get(target.url + "/v1/models", headers=target.headers())
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def scrape(client: httpx.AsyncClient, target: Target) -> dict[str, float]:
    """Counters from ``/metrics`` as ``{"name{labels}": value}``; empty if the endpoint has none."""
    try:
        response = await client.get(target.url + "/metrics")
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            try:
                out[series] = float(value)
            except ValueError:
                continue
    return out
