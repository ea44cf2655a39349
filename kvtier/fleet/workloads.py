"""Workloads: multi-round chat, long-document QA (LooGLE) and Mooncake trace replay.

Each workload is an async function ``run(runner, spec)`` that sends its requests through a ``Runner``
(which times them, bounds concurrency and advances the progress bar) and returns nothing; the runner
keeps the results. ``round`` in a result means: the chat round (multi-round), how many times the document
was asked about before (QA), the request's index (trace).
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.base.errors import ConfigError

#: Plain English words for generated conversation text: the main job needs no data files.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute "
    "idea kid body information back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education foot boy age policy "
    "music market sense nation plan college interest death experience effect use class control care field "
    "development role effort rate heart drug show leader light voice wife police mind price report decision son "
    "view relationship town road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project activity star table "
    "need court oil situation cost industry figure street image phone data picture practice piece land product "
    "doctor wall patient worker news test movie north love support technology step baby computer type attention "
    "film tree source organization hair window evidence population site river garden cache prefix memory disk"
).split()


def words(rng: random.Random, n: int) -> str:
    """``n`` seeded pseudo-English words, with a full stop every dozen or so."""
    out = []
    for i in range(n):
        out.append(rng.choice(WORDS))
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


def find_workload_file(name: str, path: str | None = None) -> Path:
    """``path`` if given, else ``$KVTIER_WORKLOADS/<name>``, else ``../shared/workloads/<name>`` next to the repo."""
    candidates = [Path(path)] if path else []
    if not path:
        if os.environ.get("KVTIER_WORKLOADS"):
            candidates.append(Path(os.environ["KVTIER_WORKLOADS"]) / name)
        repo = Path(__file__).resolve().parents[2]
        candidates += [repo.parent / "shared" / "workloads" / name, Path.cwd().parent / "shared" / "workloads" / name]
    for candidate in candidates:
        if candidate.expanduser().is_file():
            return candidate.expanduser()
    raise ConfigError(f"cannot find {name}: pass its path (--data) or set KVTIER_WORKLOADS to its folder")


# -- multi-round chat -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MultiRoundSpec:
    """``users`` conversations of ``rounds`` turns sharing one system prompt; each turn adds ``turn_words``.
    ``context_words`` (0: ``turn_words``): the length of each conversation's first user message, its own
    context (a document pasted in) that every later round carries. ``sessions``: each request names its
    conversation in OpenAI's ``user`` field (for session-sticky routers), as ``<session_prefix>-<user>``."""

    users: int = 2
    rounds: int = 4
    system_words: int = 300
    turn_words: int = 150
    max_tokens: int = 16
    seed: int = 0
    sessions: bool = False
    context_words: int = 0
    session_prefix: str = "user"


async def multiround(runner, spec: MultiRoundSpec) -> None:
    rng = random.Random(spec.seed)
    system = "You are a helpful assistant. Here are the notes of the project: " + words(rng, spec.system_words)
    histories = [[{"role": "system", "content": system},
                  {"role": "user", "content": f"I am user {u}. " + words(rng, spec.context_words or spec.turn_words)}]
                 for u in range(spec.users)]
    turns = [[words(rng, spec.turn_words) for _ in range(spec.rounds)] for _ in range(spec.users)]

    async def one(r: int, u: int) -> None:
        body = {"messages": histories[u], "max_tokens": spec.max_tokens}
        if spec.sessions:
            body["user"] = f"{spec.session_prefix}-{u}"
        result = await runner.request("/v1/chat/completions", body, workload="multiround", round=r, user=u)
        histories[u] = histories[u] + [{"role": "assistant", "content": result.text},
                                       {"role": "user", "content": turns[u][r]}]

    for r in range(spec.rounds):
        await asyncio.gather(*(one(r, u) for u in range(spec.users)))


# -- long-document QA -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QASpec:
    """``docs`` LooGLE documents (cut to ``doc_chars``), ``questions`` each, asked ``order``-ly."""

    path: str | None = None
    docs: int = 3
    questions: int = 3
    doc_chars: int = 12_000
    order: str = "interleaved"  # or "random"
    max_tokens: int = 16
    seed: int = 0


def load_loogle(path: Path, docs: int, questions: int) -> list[tuple[str, list[str]]]:
    """``[(document, [question, ...]), ...]``. ``qa_pairs`` is a Python literal: parsed, never evaluated."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if len(out) == docs:
                break
            row = json.loads(line)
            pairs = ast.literal_eval(row["qa_pairs"]) if isinstance(row["qa_pairs"], str) else row["qa_pairs"]
            out.append((row["input"], [str(p["Q"]) for p in pairs[:questions]]))
    return out


async def longdoc_qa(runner, spec: QASpec) -> None:
    if spec.order not in ("interleaved", "random"):
        raise ConfigError(f"order must be 'interleaved' or 'random', not {spec.order!r}")
    items = load_loogle(find_workload_file("loogle_longdep_qa.jsonl", spec.path), spec.docs, spec.questions)
    schedule = [(d, q) for q in range(spec.questions) for d in range(len(items)) if q < len(items[d][1])]
    if spec.order == "random":
        random.Random(spec.seed).shuffle(schedule)
    seen: dict[int, int] = {}
    for d, q in schedule:
        doc, questions = items[d]
        messages = [{"role": "system", "content": "Answer the question from the document, briefly."},
                    {"role": "user", "content": f"Document:\n{doc[: spec.doc_chars]}\n\nQuestion: {questions[q]}"}]
        visit = seen.get(d, 0)
        seen[d] = visit + 1
        await runner.request("/v1/chat/completions", {"messages": messages, "max_tokens": spec.max_tokens},
                             workload="qa", round=visit, user=d)


# -- Mooncake trace replay --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceSpec:
    """Requests of a Mooncake trace; each 512-token block id becomes ``block_tokens`` token ids.

    ``conversations`` 0: the trace's first ``requests`` rows, in order. ``conversations`` N: N of the trace's
    conversations (the rows that share their first block id) of at least ``min_turns`` rows, drawn with ``seed``,
    each cut to its first ``max_turns`` rows (0: whole), at most ``requests`` rows of them in trace order; sent back
    to back, each conversation's turns in order and the conversations side by side (the runner bounds how many are
    in flight). ``salt`` (0: none) gives every block other token ids, so runs with different salts share nothing.
    ``sessions``: each request names its conversation in OpenAI's ``user`` field."""

    path: str | None = None
    requests: int = 20
    block_tokens: int = 64
    max_prompt_tokens: int = 4096
    max_tokens: int = 16
    timestamps: bool = False
    speed: float = 1.0
    token_range: tuple[int, int] = (1000, 30000)
    conversations: int = 0
    min_turns: int = 4
    max_turns: int = 0
    seed: int = 0
    salt: int = 0
    sessions: bool = False


def block_tokens(block_id: int, n: int, token_range: tuple[int, int], salt: int = 0) -> list[int]:
    """Deterministic token run of one block: equal ids (and salts) give equal runs, on every machine."""
    rng = np.random.default_rng([0x6B76, block_id, salt] if salt else [0x6B76, block_id])
    return rng.integers(token_range[0], token_range[1], size=n).tolist()


def trace_rows(spec: TraceSpec) -> list[tuple[int, int, dict]]:
    """``(row index, conversation, row)`` of the rows ``spec`` selects, in trace order (conversation 0 for all
    when ``spec.conversations`` is 0)."""
    path = find_workload_file("mooncake_synthetic_trace.jsonl", spec.path)
    with open(path, encoding="utf-8") as fh:
        if not spec.conversations:
            rows = []
            for i, line in enumerate(fh):
                if i == spec.requests:
                    break
                rows.append((i, 0, json.loads(line)))
            return rows
        every = [json.loads(line) for line in fh if line.strip()]
    by_first: dict[int, list[int]] = {}
    for i, row in enumerate(every):
        by_first.setdefault(row["hash_ids"][0], []).append(i)
    candidates = sorted(first for first, idx in by_first.items() if len(idx) >= spec.min_turns)
    if len(candidates) < spec.conversations:
        raise ConfigError(f"{path}: {len(candidates)} conversations of {spec.min_turns}+ turns, "
                          f"{spec.conversations} asked for")
    if spec.max_turns and spec.max_turns < spec.min_turns:
        raise ConfigError(f"max_turns {spec.max_turns} is below min_turns {spec.min_turns}")
    picked = random.Random(spec.seed).sample(candidates, spec.conversations)
    conversation = {i: c for c, first in enumerate(picked) for i in by_first[first][: spec.max_turns or None]}
    return [(i, conversation[i], every[i]) for i in sorted(conversation)[: spec.requests]]


def trace_prompt(row: dict, spec: TraceSpec) -> list[int]:
    """The row's prompt: its blocks' token runs, ``input_length`` scaled by ``block_tokens / 512`` and capped."""
    length = min(max(1, row["input_length"] * spec.block_tokens // 512), spec.max_prompt_tokens)
    prompt: list[int] = []
    for block in row["hash_ids"]:
        if len(prompt) >= length:
            break
        prompt += block_tokens(block, spec.block_tokens, spec.token_range, spec.salt)
    return prompt[:length]


def trace_requests(spec: TraceSpec) -> Iterator[tuple[float, list[int], int]]:
    """``(arrival seconds, prompt token ids, max_tokens)`` per selected trace row, prompts scaled and capped."""
    for _i, _conversation, row in trace_rows(spec):
        yield row["timestamp"] / 1000.0, trace_prompt(row, spec), max(1, min(row["output_length"], spec.max_tokens))


async def trace_replay(runner, spec: TraceSpec) -> None:
    """Replay: at the trace's (``speed``-scaled) arrival times, or back to back (by conversation, see
    ``TraceSpec``). A request's ``round`` is its row index, its ``user`` its conversation."""
    start = time.perf_counter()
    rows = trace_rows(spec)

    def body(row: dict, conversation: int) -> dict:
        out = {"prompt": trace_prompt(row, spec), "max_tokens": max(1, min(row["output_length"], spec.max_tokens))}
        if spec.sessions:
            out["user"] = f"conversation-{conversation}"
        return out

    if not spec.timestamps:
        async def turns(c: int) -> None:
            for i, conversation, row in rows:
                if conversation == c:
                    await runner.request("/v1/completions", body(row, c), workload="trace", round=i, user=c)
        await asyncio.gather(*(turns(c) for c in sorted({c for _, c, _ in rows})))
        return
    tasks = []
    for i, conversation, row in rows:
        delay = row["timestamp"] / 1000.0 / spec.speed - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(runner.request(
            "/v1/completions", body(row, conversation), workload="trace", round=i, user=conversation, bounded=False)))
    await asyncio.gather(*tasks)


def count(workload: str, spec) -> int:
    """How many requests a workload will send (for the progress bar)."""
    if workload == "multiround":
        return spec.users * spec.rounds
    if workload == "qa":
        return spec.docs * spec.questions
    if spec.conversations:
        return len(trace_rows(spec))
    return spec.requests


#: workload name -> the coroutine that sends its requests through a runner (kvtier bench; kvtier sim replays them)
WORKLOADS = {"multiround": multiround, "qa": longdoc_qa, "trace": trace_replay}
