"""A synthetic chat / agent / RAG workload in the Mooncake trace format, with a reuse shape of its own.

Sessions arrive at random (Poisson). Each uses one of a few applications (Zipf popularity), whose system
prompt every session of that application shares; a share of sessions then quote one document of a corpus
(Zipf popularity: RAG). A session runs several turns: each prompt is the whole previous prompt, the
previous answer and a new user message (chat), and agent sessions run many quick turns whose messages are
long tool outputs. Prompts are cut into 512-token blocks exactly as a server cuts tokens: blocks are named
by their content and everything before them (a trie of ids), so the last, partial block of a prompt differs
from the full block the next turn has at that place, as in the Mooncake trace.

It complements the Mooncake trace: reuse comes from long-lived shared prefixes (system prompts, popular
documents) and from conversations whose next turn comes back after a think time, not from one trace's mix.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.apps.sim.trace import TRACE_BLOCK_TOKENS

Segment = tuple[int, int]  # (segment id, tokens)


@dataclass(frozen=True)
class SyntheticWorkload:
    """Sizes in tokens, times in seconds. The defaults give about 4,800 requests over 20 minutes, whose 17,000
    distinct blocks are mostly reused within a few minutes (1,000-3,000 chunks is where policies differ)."""

    sessions: int = 1000
    session_rate_per_s: float = 1.0
    apps: int = 40
    system_tokens: tuple[int, int] = (800, 6000)
    docs: int = 2000
    doc_share: float = 0.35
    doc_tokens: tuple[int, int] = (1000, 12000)
    agent_share: float = 0.25
    think_s: float = 300.0  #: mean pause before a chat user's next turn (agents: a tenth of it)
    seed: int = 0


class _Blocks:
    """Names 512-token blocks by their content and their parent block (a trie)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def ids(self, segments: list[Segment]) -> list[int]:
        out: list[int] = []
        parent, window, room = -1, [], TRACE_BLOCK_TOKENS
        for seg, length in segments:
            offset = 0
            while offset < length:
                take = min(room, length - offset)
                window.append((seg, offset, offset + take))
                offset, room = offset + take, room - take
                if room == 0:
                    parent = self._id(parent, window)
                    out.append(parent)
                    window, room = [], TRACE_BLOCK_TOKENS
        if window:
            out.append(self._id(parent, window))
        return out

    def _id(self, parent: int, window: list[tuple[int, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(window)), len(self._ids))


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def _sessions(spec: SyntheticWorkload, rng: random.Random) -> Iterator[tuple[float, list[list[Segment]], list[int]]]:
    """Per session: turn arrival times, each turn's prompt segments, each turn's answer length."""
    apps = [rng.randint(*spec.system_tokens) for _ in range(spec.apps)]
    docs = [rng.randint(*spec.doc_tokens) for _ in range(spec.docs)]
    fresh = iter(range(spec.apps + spec.docs, 1 << 62))
    start = 0.0
    for _ in range(spec.sessions):
        start += rng.expovariate(spec.session_rate_per_s)
        app = _zipf(rng, spec.apps)
        prompt: list[Segment] = [(app, apps[app])]
        if rng.random() < spec.doc_share:
            doc = _zipf(rng, spec.docs)
            prompt.append((spec.apps + doc, docs[doc]))
        agent = rng.random() < spec.agent_share
        turns = 1 + min(int(rng.expovariate(1 / (8 if agent else 3))), 40)
        at, times, prompts, answers = start, [], [], []
        for _ in range(turns):
            prompt = prompt + [(next(fresh), rng.randint(200, 2500) if agent else rng.randint(20, 400))]
            times.append(at)
            prompts.append(prompt)
            answers.append(rng.randint(30, 300) if agent else rng.randint(50, 600))
            prompt = prompt + [(next(fresh), answers[-1])]
            at += rng.expovariate(1 / (spec.think_s / 10 if agent else spec.think_s))
        yield times, prompts, answers


def generate(spec: SyntheticWorkload = SyntheticWorkload()) -> list[dict]:
    """Mooncake-format rows, by arrival time."""
    rng = random.Random(spec.seed)
    blocks = _Blocks()
    rows = []
    for times, prompts, answers in _sessions(spec, rng):
        for at, prompt, answer in zip(times, prompts, answers):
            length = sum(n for _, n in prompt)
            rows.append({"timestamp": int(at * 1000), "input_length": length, "output_length": answer,
                         "hash_ids": blocks.ids(prompt)})
    rows.sort(key=lambda row: row["timestamp"])
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / TRACE_BLOCK_TOKENS) for r in rows)
    return rows


def write(path: str | Path, spec: SyntheticWorkload = SyntheticWorkload()) -> Path:
    """Write the workload as a Mooncake-format JSONL file (what ``kvtier sim`` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in generate(spec):
            fh.write(json.dumps(row) + "\n")
    return path
