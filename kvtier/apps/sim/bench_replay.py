"""Replay a ``kvtier bench`` result file: the prompts it sent, rebuilt by the bench's own workload code.

A bench JSON records every request's answer but not its prompt. The workloads are deterministic given their
spec (saved in the file) and the answers (multi-round chat feeds each answer into the next prompt), so this
module runs the workload again against a stand-in runner that answers each request with the recorded text
and keeps the prompt it was given. Chat prompts become token ids through a fixed word-level tokenizer
(words and punctuation, each hashed to an id): not the served model's tokenizer, but prefix-preserving,
which is all a prefix cache sees. Token counts and chunk sizes are then in these tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvtier.apps.sim.trace import TokenPrompt, TraceRequest
from kvtier.base.errors import ConfigError
from kvtier.fleet.draws import prompt_digest

_PIECES = re.compile(r"\w+|[^\w\s]")


def chat_token_ids(messages: list[dict[str, Any]]) -> np.ndarray:
    """Token ids of a chat prompt: role markers, then each word or punctuation mark as crc32 of its bytes."""
    ids: list[int] = []
    for message in messages:
        for piece in [f"<|{message.get('role', '')}|>", *_PIECES.findall(str(message.get("content", "")))]:
            ids.append(zlib.crc32(piece.encode("utf-8")))
    ids.append(zlib.crc32(b"<|assistant|>"))
    return np.asarray(ids, dtype="<u4")


class _ReplayRunner:
    """Stands in for kvtier.apps.bench's Runner: keeps each prompt, answers with the recorded result."""

    def __init__(self, recorded: dict[tuple[int, int], dict[str, Any]]) -> None:
        self.recorded = recorded
        self.sent: list[tuple[int, int, dict[str, Any]]] = []

    async def request(self, path: str, body: dict[str, Any], *, workload: str, round: int, user: int,
                      bounded: bool = True) -> SimpleNamespace:
        self.sent.append((round, user, body))
        result = self.recorded.get((round, user), {})
        return SimpleNamespace(text=result.get("text") or "", status=result.get("status", 0))


#: a chat's token ids as the served model's server computes them (kvtier.integrations.prompts.PromptTokenizer.chat)
ChatTokenizer = Callable[[list[dict[str, Any]]], "Sequence[int] | None"]


def read_bench_json(path: str | Path, *, chunk_tokens: int, target: str | None = None,
                    limit: int | None = None, tokenizer: ChatTokenizer | None = None) -> list[TraceRequest]:
    """The requests of one target's run in a bench JSON, in the order they were sent. ``tokenizer``: chat prompts
    become the served model's token ids, so chunk and block boundaries fall where the server's did (default:
    :func:`chat_token_ids`, word-level ids)."""
    from kvtier.fleet import workloads as wl

    doc = _load(path)
    runs = doc.get("runs") or []
    run = next((r for r in runs if target is None or r.get("target") == target), None)
    if run is None:
        raise ConfigError(f"{path}: no run for target {target!r}; runs: {[r.get('target') for r in runs]}")
    workload = doc.get("config", {}).get("workload")
    specs = {"multiround": wl.MultiRoundSpec, "qa": wl.QASpec, "trace": wl.TraceSpec}
    if workload not in specs:
        raise ConfigError(f"{path}: unknown workload {workload!r}")
    spec = _spec(specs[workload], doc["config"].get("spec", {}), path)
    if workload == "trace":
        spec = dataclasses.replace(spec, timestamps=False)  # prompts only: never wait for arrival times
    recorded = {(int(r["round"]), int(r["user"])): r for r in run.get("requests", [])}
    runner = _ReplayRunner(recorded)
    asyncio.run(wl.WORKLOADS[workload](runner, spec=spec))
    out = []
    for round_, user, body in runner.sent:
        ids = np.asarray(body["prompt"], dtype="<u4") if "prompt" in body else _chat_ids(body["messages"], tokenizer)
        result = recorded.get((round_, user), {})
        out.append(TraceRequest(float(result.get("sent_at", 0.0)), TokenPrompt(ids), len(ids),
                                int(result.get("completion_tokens") or 0), chunk_tokens, f"{workload}:{user}",
                                _seconds(result.get("ttft_s")), _seconds(result.get("e2e_s")), _draw_key(body),
                                _replica(result.get("replica"))))
    out = _in_router_order(out, [_decision(recorded.get((r, u), {}).get("decision")) for r, u, _ in runner.sent])
    return out[:limit] if limit is not None else out


def read_background(paths: Sequence[str | Path], *, chunk_tokens: int,
                    but: tuple[str | Path, str | None] | None = None,
                    tokenizer: ChatTokenizer | None = None) -> list[TraceRequest]:
    """Every run's requests in the bench JSONs ``paths``, but the run being replayed itself (``but``: its file
    and target, None for the file's first run): what else went through the replicas at the time
    (kvtier.apps.sim.replay's ``background``)."""
    skip = None
    if but is not None:
        runs = _load(but[0]).get("runs") or [{}]
        skip = (Path(but[0]).resolve(), but[1] if but[1] is not None else runs[0].get("target"))
    out: list[TraceRequest] = []
    for path in paths:
        for run in _load(path).get("runs") or []:
            if (Path(path).resolve(), run.get("target")) != skip:
                out += read_bench_json(path, chunk_tokens=chunk_tokens, target=run.get("target"), tokenizer=tokenizer)
    return out


def _in_router_order(requests: list[TraceRequest], decisions: list[int | None]) -> list[TraceRequest]:
    """By arrival; in the router's decision order where every request has its number (``x-kvtier-decision``):
    requests sent within milliseconds of each other reach a router in either order, and a round-robin router's
    choices follow that order. A request decided after one sent later arrives with it (arrivals never go back),
    and still ends when it ended: its measured times are shortened by the shift, so a replica it held is free
    again for the decisions that followed its end, as it was for the router."""
    if not requests or any(d is None for d in decisions):
        return sorted(requests, key=lambda r: r.arrival_s)
    ordered = [r for _, r in sorted(zip(decisions, requests), key=lambda pair: pair[0])]
    latest = float("-inf")
    out = []
    for request in ordered:
        latest = max(latest, request.arrival_s)
        out.append(request if request.arrival_s == latest else _arriving_at(request, latest))
    return out


def _arriving_at(request: TraceRequest, arrival_s: float) -> TraceRequest:
    shift = arrival_s - request.arrival_s
    ttft, e2e = request.measured_ttft_s, request.measured_e2e_s
    return dataclasses.replace(request, arrival_s=arrival_s,
                               measured_ttft_s=None if ttft is None else max(ttft - shift, 0.0),
                               measured_e2e_s=None if e2e is None else max(e2e - shift, 0.0))


def _chat_ids(messages: list[dict[str, Any]], tokenizer: ChatTokenizer | None) -> np.ndarray:
    if tokenizer is None:
        return chat_token_ids(messages)
    ids = tokenizer([{"role": str(m.get("role", "")), "content": str(m.get("content", ""))} for m in messages])
    if ids is None:
        raise ConfigError("the tokenizer has no chat template: chat prompts cannot become the model's token ids")
    return np.asarray(ids, dtype="<u4")


def _draw_key(body: dict[str, Any]) -> bytes:
    """The digest kvtier route's random tie-break drew from for this body (kvtier.fleet.draws)."""
    if "messages" in body:
        return prompt_digest(messages=[{"role": m.get("role", ""), "content": str(m.get("content", ""))}
                                       for m in body["messages"]])
    prompt = body.get("prompt")
    return prompt_digest(text=prompt) if isinstance(prompt, str) else prompt_digest(ids=prompt or None)


def _decision(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _replica(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value >= 0 else None


def _load(path: str | Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read bench results {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a kvtier bench result (a JSON object)")
    return doc


def _spec(cls: type, values: dict[str, Any], path: str | Path) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    try:
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in known}
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{path}: bad workload spec ({exc})") from None
