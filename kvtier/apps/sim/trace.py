"""Requests to replay: a Mooncake-format trace, or the per-request JSON that ``kvtier bench`` writes.

Mooncake format (one JSON object per line)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

Each hash id names one 512-token block of prompt; equal ids are equal blocks (and, since the ids are
prefix-dependent, equal prefixes). The simulator turns every block id into ``block_tokens`` deterministic
token ids, so kvtier's own chained hashing sees the trace's sharing structure: one block is one chunk. With
``cut_tail`` the prompt is cut to ``input_length`` (scaled), so a partial last block is, as in a real
server, no chunk at all; without it every block is a full chunk (the block-level model of the trace's
reference figures).

A ``kvtier bench`` JSON is replayed by running the bench's own workload code again with the recorded
answers (``kvtier.apps.sim.bench_replay``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from kvtier.base.errors import ConfigError

TRACE_BLOCK_TOKENS = 512  #: tokens per block in Mooncake traces

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mixing function (SplitMix64's finaliser), vectorised; wraps modulo 2**64."""
    with np.errstate(over="ignore"):
        x = (x + _GOLDEN) & np.uint64(0xFFFFFFFFFFFFFFFF)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def block_token_ids(blocks: np.ndarray, block_tokens: int) -> np.ndarray:
    """``block_tokens`` token ids per block id, equal ids giving equal runs on every machine (uint32)."""
    positions = np.arange(block_tokens, dtype=np.uint64)
    seeds = blocks.astype(np.uint64)[:, None] * np.uint64(block_tokens) + positions[None, :]
    return (_splitmix64(seeds) >> np.uint64(32)).astype("<u4").reshape(-1)


class Prompt(Protocol):
    def tokens(self) -> np.ndarray:
        """The prompt's token ids (uint32)."""


@dataclass(frozen=True)
class BlockPrompt:
    """A prompt given as trace blocks, expanded to tokens when replayed (a trace holds no token ids)."""

    blocks: tuple[int, ...]
    block_tokens: int
    #: token count of the prompt in simulator tokens: cuts a partial last block, or None for full blocks
    length: int | None = None

    def tokens(self) -> np.ndarray:
        ids = block_token_ids(np.asarray(self.blocks, dtype=np.int64), self.block_tokens)
        return ids if self.length is None else ids[: self.length]


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt given as token ids."""

    ids: np.ndarray

    def tokens(self) -> np.ndarray:
        return self.ids


@dataclass(frozen=True)
class TraceRequest:
    """One request of a replayed workload."""

    arrival_s: float
    prompt: Prompt
    #: the prompt's length in the workload's own tokens (what prefill would compute without a cache)
    input_tokens: int
    output_tokens: int
    #: the workload's tokens per simulator chunk: turns hit chunks into saved prefill tokens
    tokens_per_chunk: int
    session: str | None = None
    #: a recorded run's time to first token and to the last one (None: unknown); when known, the replay holds
    #: the request in flight on its replica that long, as the router counted it, instead of modelling it
    measured_ttft_s: float | None = None
    measured_e2e_s: float | None = None
    #: the digest of the prompt as its client sent it (kvtier.fleet.draws), which a random tie-break draws from
    draw_key: bytes = b""
    #: the replica a recorded run's router sent it to, by the router's name for it (None: not recorded)
    measured_replica: str | None = None


def read_mooncake(path: str | Path, *, block_tokens: int = TRACE_BLOCK_TOKENS, cut_tail: bool = False,
                  limit: int | None = None) -> list[TraceRequest]:
    """The requests of a Mooncake-format JSONL trace (raises ConfigError naming a malformed line)."""
    if block_tokens <= 0:
        raise ConfigError(f"block_tokens must be positive, got {block_tokens}")
    out: list[TraceRequest] = []
    for lineno, row in _json_lines(path):
        if limit is not None and len(out) >= limit:
            break
        try:
            blocks = tuple(int(b) for b in row["hash_ids"])
            length, output = int(row["input_length"]), int(row.get("output_length", 0))
            arrival = float(row.get("timestamp", 0)) / 1000.0
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}:{lineno}: not a Mooncake trace row ({exc!r})") from None
        if any(b < 0 for b in blocks) or length < 0:
            raise ConfigError(f"{path}:{lineno}: negative block id or length")
        cut = -(-length * block_tokens // TRACE_BLOCK_TOKENS) if cut_tail else None
        out.append(TraceRequest(arrival, BlockPrompt(blocks, block_tokens, cut), length, output,
                                TRACE_BLOCK_TOKENS))
    return out


def _json_lines(path: str | Path) -> Iterator[tuple[int, dict]]:
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{lineno}: not JSON ({exc})") from None
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}:{lineno}: expected a JSON object")
                yield lineno, row
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from None


def is_mooncake(path: str | Path) -> bool:
    """True when the file's first line is a Mooncake trace row (a ``kvtier bench`` JSON is one document)."""
    try:
        with open(path, encoding="utf-8") as fh:
            first = fh.readline()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from None
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and "hash_ids" in row
