"""The Mooncake trace's conversation sampling: which rows, in which order, with which tokens."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from kvtier.base.errors import ConfigError
from kvtier.fleet import workloads as wl


def _trace(tmp_path):
    # conversations by first block: 10 (4 turns), 20 (4 turns), 30 (2 turns), 40 (1 turn), interleaved in time
    firsts = [10, 20, 10, 30, 20, 10, 40, 20, 30, 10, 20]
    rows = [{"timestamp": 100 * i, "input_length": 512 * (2 + i % 3), "output_length": 5,
             "hash_ids": [first] + [1000 + 10 * i + j for j in range(1 + i % 3)]} for i, first in enumerate(firsts)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class _Recorder:
    def __init__(self):
        self.sent = []
        self.open = 0
        self.most_open = 0

    async def request(self, path, body, *, workload, round, user, bounded=True):
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        self.sent.append((round, user, body))
        await asyncio.sleep(0)
        self.open -= 1
        return SimpleNamespace(text="", status=200)


def test_conversations_are_drawn_whole_and_kept_in_trace_order(tmp_path):
    spec = wl.TraceSpec(path=str(_trace(tmp_path)), requests=100, block_tokens=8, conversations=2, min_turns=3)
    rows = wl.trace_rows(spec)
    firsts = {row["hash_ids"][0] for _, _, row in rows}
    assert firsts == {10, 20}  # only the conversations of 3+ turns
    assert [i for i, _, _ in rows] == sorted(i for i, _, _ in rows) and len(rows) == 8
    by_conversation = {}
    for _, c, row in rows:
        by_conversation.setdefault(c, set()).add(row["hash_ids"][0])
    assert all(len(v) == 1 for v in by_conversation.values()) and len(by_conversation) == 2
    assert wl.count("trace", spec) == 8
    capped = wl.TraceSpec(path=spec.path, requests=5, block_tokens=8, conversations=2, min_turns=3)
    assert [i for i, _, _ in wl.trace_rows(capped)] == [i for i, _, _ in rows][:5]
    with pytest.raises(ConfigError, match="conversations"):
        wl.trace_rows(wl.TraceSpec(path=spec.path, conversations=3, min_turns=3))


def test_max_turns_keeps_each_conversations_first_turns(tmp_path):
    whole = wl.TraceSpec(path=str(_trace(tmp_path)), requests=100, block_tokens=8, conversations=2, min_turns=3)
    cut = wl.TraceSpec(**{**whole.__dict__, "max_turns": 3})
    rows, kept = wl.trace_rows(whole), wl.trace_rows(cut)
    turns = {}
    for i, c, _ in rows:
        turns.setdefault(c, []).append(i)
    assert max(len(v) for v in turns.values()) > 3  # the cut must drop something
    assert [i for i, _, _ in kept] == sorted(i for v in turns.values() for i in v[:3])
    assert wl.count("trace", cut) == len(kept) == 6
    with pytest.raises(ConfigError, match="max_turns"):
        wl.trace_rows(wl.TraceSpec(**{**whole.__dict__, "max_turns": 2}))


def test_replay_keeps_each_conversation_in_order_and_runs_them_side_by_side(tmp_path):
    spec = wl.TraceSpec(path=str(_trace(tmp_path)), requests=100, block_tokens=8, conversations=2, min_turns=3,
                        sessions=True, max_tokens=2)
    runner = _Recorder()
    asyncio.run(wl.trace_replay(runner, spec))
    assert len(runner.sent) == 8 and runner.most_open == 2
    for user in {u for _, u, _ in runner.sent}:
        turns = [(r, b) for r, u, b in runner.sent if u == user]
        assert [r for r, _ in turns] == sorted(r for r, _ in turns)
        assert {b["user"] for _, b in turns} == {f"conversation-{user}"}
        first = turns[0][1]["prompt"][:8]
        assert all(b["prompt"][:8] == first for _, b in turns)  # one first block: a shared prefix
        assert all(b["max_tokens"] == 2 for _, b in turns)


def test_salt_changes_every_token_and_no_salt_keeps_the_old_runs(tmp_path):
    base = wl.TraceSpec(path=str(_trace(tmp_path)), requests=100, block_tokens=8, conversations=2, min_turns=3)
    salted = wl.TraceSpec(**{**base.__dict__, "salt": 5})
    plain = [p for _, p, _ in wl.trace_requests(base)]
    other = [p for _, p, _ in wl.trace_requests(salted)]
    assert [len(p) for p in plain] == [len(p) for p in other]
    assert all(a[:8] != b[:8] for a, b in zip(plain, other))
    assert wl.block_tokens(10, 8, base.token_range) == wl.block_tokens(10, 8, base.token_range, 0)
    assert plain[0][:8] == wl.block_tokens(10, 8, base.token_range) or plain[0][:8] == wl.block_tokens(
        20, 8, base.token_range)
