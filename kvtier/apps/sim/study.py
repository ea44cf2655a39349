"""A study: one trace replayed through a fleet for each (capacity, policy) pair, with the references.

``capacity`` is the chunks of every replica's first tier together (split evenly between replicas), so a
4-replica fleet at 10,000 chunks has 2,500 per replica: the same memory as one cache of 10,000. The
references are computed for one pooled cache of the fleet's whole capacity (every tier of every replica,
plus the shared tier): the most any placement of those chunks could hit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.apps.sim.fleet import FleetConfig
from kvtier.apps.sim.reference import belady_hits, ideal_hits, next_uses
from kvtier.apps.sim.replay import SimResult, replay
from kvtier.apps.sim.replica import SIM_MODEL, SIM_SPEC
from kvtier.apps.sim.trace import TraceRequest
from kvtier.base.errors import ConfigError
from kvtier.base.keys import ChunkHash, Namespace


@dataclass
class Point:
    """One replay of the study and the offline optimum at the same capacity."""

    capacity: int
    policy: str
    result: SimResult
    belady: float | None


@dataclass
class Study:
    chunks: int
    ideal: float
    points: list[Point] = field(default_factory=list)

    def lru(self, capacity: int) -> Point | None:
        return next((p for p in self.points if p.capacity == capacity and p.policy == "lru"), None)

    def vs_lru(self, point: Point) -> float | None:
        """The point's chunk hit ratio over LRU's at the same capacity."""
        lru = self.lru(point.capacity)
        if lru is None or not lru.result.chunk_hit_ratio:
            return None
        return point.result.chunk_hit_ratio / lru.result.chunk_hit_ratio

    def gap_closed(self, point: Point) -> float | None:
        """Share of the LRU-to-Belady gap the point closes (1.0: as good as the offline optimum)."""
        lru = self.lru(point.capacity)
        if lru is None or point.belady is None or point.belady <= lru.result.chunk_hit_ratio:
            return None
        return (point.result.chunk_hit_ratio - lru.result.chunk_hit_ratio) / (point.belady - lru.result.chunk_hit_ratio)

    def to_json(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "ideal_chunk_hit_ratio": self.ideal, "points": [
            {"capacity": p.capacity, "policy": p.policy, "belady_chunk_hit_ratio": p.belady,
             "vs_lru": self.vs_lru(p), "gap_closed": self.gap_closed(p), **p.result.to_json()}
            for p in self.points]}


def with_first_tier(fleet: FleetConfig, capacity: int | None, policy: str | None) -> FleetConfig:
    """``fleet`` with its replicas' first tier holding ``capacity`` chunks in all and evicting by ``policy``."""
    first = fleet.tiers[0]
    changes: dict[str, Any] = {}
    if capacity is not None:
        changes.update(chunks=capacity // fleet.replicas, capacity_bytes=None)
    if policy is not None:
        changes["policy"] = policy
    return dataclasses.replace(fleet, tiers=(dataclasses.replace(first, **changes), *fleet.tiers[1:]))


def pooled_capacity(fleet: FleetConfig, chunk_kv_bytes: int) -> int:
    own = sum(t.capacity_chunks(chunk_kv_bytes) for t in fleet.tiers) * fleet.replicas
    return own + (fleet.shared.capacity_chunks(chunk_kv_bytes) if fleet.shared is not None else 0)


def chunk_chains(requests: Sequence[TraceRequest], chunk_tokens: int) -> list[list[ChunkHash]]:
    """Every request's chunk keys, exactly as the replicas' caches compute them."""
    namespace = Namespace(SIM_MODEL, SIM_SPEC, chunk_tokens)
    return [namespace.chunk_hashes(r.prompt.tokens()) for r in requests]


def run_study(requests: Sequence[TraceRequest], fleet: FleetConfig, chunk_tokens: int, *,
              capacities: Sequence[int | None] = (None,), policies: Sequence[str | None] = (None,),
              belady: bool = True, model: str = SIM_MODEL,
              progress: Callable[[int], None] | None = None, background: Sequence[TraceRequest] = ()) -> Study:
    """Replay ``requests`` once per (capacity, policy); None keeps the fleet's own value. ``background``: other
    runs' requests placed where they ran (kvtier.apps.sim.replay)."""
    if not requests:
        raise ConfigError("the trace has no requests")
    chains = chunk_chains(requests, chunk_tokens)
    total = sum(len(c) for c in chains)
    study = Study(total, ideal_hits(chains) / total if total else 0.0)
    upcoming = next_uses(chains) if belady else None
    chunk_kv_bytes = fleet.kv_bytes_per_token * requests[0].tokens_per_chunk
    done = 0
    for capacity in capacities:
        sized = with_first_tier(fleet, capacity, None)
        optimum = None
        if belady and total:
            optimum = belady_hits(chains, pooled_capacity(sized, chunk_kv_bytes), upcoming) / total
        for policy in policies:
            config = with_first_tier(sized, None, policy)
            label = f"{config.tiers[0].policy} @ {capacity if capacity is not None else 'fleet'}"
            step = (lambda n, base=done: progress(base + n)) if progress is not None else None
            result = replay(requests, config, chunk_tokens, label=label, model=model, progress=step,
                            background=background)
            done += len(requests)
            first = config.tiers[0].capacity_chunks(chunk_kv_bytes) * config.replicas
            study.points.append(Point(first, config.tiers[0].policy, result, optimum))
    return study
