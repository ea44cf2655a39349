"""Pooled against private memory at the same total capacity: what a Mooncake pool is worth to a fleet.

Three fleets of ``replicas`` replicas, each with ``total`` chunks of memory in all, replay the same requests
behind the same routing:

* ``private``: every replica keeps ``total / replicas`` chunks in its own memory tier, seen by it alone;
* ``pooled``: the replicas contribute all of it to one shared tier that every replica reads and writes (a
  Mooncake pool) and keep nothing of their own;
* ``mixed``: every replica keeps ``private_share x total / replicas`` chunks of its own in front of a pool of
  the rest, as a replica with a small memory tier and a large contribution would.

Every tier evicts by LRU: Mooncake's master evicts approximately least recently used over the whole pool, and
one policy everywhere keeps the comparison about where the memory sits, not how it evicts. The chains are
inclusive, as kvtier's are: a store writes every tier, and a pool hit is promoted into the replica's own tier,
so in ``mixed`` the private tiers hold copies of pooled chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.apps.sim.fleet import FleetConfig, SimTier
from kvtier.apps.sim.replay import replay
from kvtier.apps.sim.trace import TraceRequest
from kvtier.base.errors import ConfigError
from kvtier.fleet.scoring import Routing, RoutingConfig

ARMS = ("private", "pooled", "mixed")
POOL_POLICY = "lru"


def fleets(total: int, replicas: int, routing: Routing, private_share: float) -> dict[str, FleetConfig]:
    """The three arms' fleets, each holding exactly ``total`` chunks (see the module docstring)."""
    if total < replicas or not 0.0 <= private_share <= 1.0:
        raise ConfigError(f"need total >= replicas and 0 <= private_share <= 1, got {total}, {private_share}")
    own = int(total * private_share) // replicas
    route = RoutingConfig(routing)

    def fleet(own_chunks: int, pool_chunks: int) -> FleetConfig:
        shared = SimTier(chunks=pool_chunks, policy=POOL_POLICY) if pool_chunks else None
        return FleetConfig(replicas=replicas, tiers=(SimTier(chunks=own_chunks, policy=POOL_POLICY),),
                           shared=shared, routing=route)

    return {"private": fleet(total // replicas, 0), "pooled": fleet(0, total),
            "mixed": fleet(own, total - own * replicas)}


@dataclass(frozen=True)
class PoolPoint:
    """The three arms' chunk hit ratios at one total capacity and routing."""

    total: int
    routing: Routing
    hit: dict[str, float]

    def vs_private(self, arm: str) -> float | None:
        private = self.hit["private"]
        return self.hit[arm] / private if private else None


def compare(requests: Sequence[TraceRequest], chunk_tokens: int, *, totals: Sequence[int],
            routings: Sequence[Routing], replicas: int = 4, private_share: float = 0.125,
            progress: Callable[[int], None] | None = None) -> list[PoolPoint]:
    """Replay ``requests`` through every arm at every total capacity and routing; ``progress`` gets the
    number of requests replayed so far."""
    points, done = [], 0
    for total in totals:
        for routing in routings:
            hit = {}
            for arm, fleet in fleets(total, replicas, routing, private_share).items():
                step = (lambda n, base=done: progress(base + n)) if progress is not None else None
                hit[arm] = replay(requests, fleet, chunk_tokens, label=arm, progress=step).chunk_hit_ratio
                done += len(requests)
            points.append(PoolPoint(total, routing, hit))
    return points
