"""Which replica should serve a request: pure decisions over the router's view of the fleet.

The view of one replica for one request is a ``ReplicaView``: how many tokens of the request's prefix the
replica holds, per tier (each chunk counted once, in the fastest tier holding it), and its load (requests in
flight). Every ``RoutingPolicy`` turns a request and the views into a replica index. ``kvtier sim`` and the
HTTP router import this one module, so what the simulator predicts is what the router does.

Policies:

* ``RoundRobin`` and ``RandomChoice``: ignore the cache (baselines).
* ``PrefixAffinity``: the replica expected to save the most prefill (tier-weighted cached tokens).
* ``LoadBoundedAffinity``: the same, among replicas within the load bound of consistent hashing with
  bounded loads (Mirrokni et al., 2018): a replica may take the request only if its in-flight requests, plus
  this one, stay within ``ceil((1 + epsilon) x (all in flight + 1) / replicas)``. No replica runs far above
  the mean while the others idle, whatever the prefix sharing.
* ``StickySessions``: a session's later requests go where its first one went (chosen by an inner policy),
  unless that replica is above the load bound.

Ties (no replica holds anything, or several hold the same) are broken by load, then by rendezvous hashing of
the request's first chunk key, so a new prefix has a stable home from its first request on.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica for one request."""

    #: tokens of the request's prefix the replica holds, by tier name (each chunk in its fastest tier)
    cached: Mapping[str, int] = field(default_factory=dict)
    #: requests in flight on the replica
    load: float = 0.0


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request before choosing."""

    prompt_tokens: int
    #: the key of the prompt's first chunk (b"" for a prompt shorter than a chunk): the tie-breaker's input
    first_key: bytes = b""
    #: a conversation or client id, for sticky sessions
    session: str | None = None


class RoutingPolicy(Protocol):
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        """Index of the replica that serves ``request``. ``replicas`` is never empty."""


def expected_saved_tokens(view: ReplicaView, tier_weights: Mapping[str, float]) -> float:
    """Prefill tokens the replica is expected to save: cached tokens, weighted by tier (1.0 when unnamed)."""
    return sum(tokens * tier_weights.get(tier, 1.0) for tier, tokens in view.cached.items())


def load_bound(replicas: Sequence[ReplicaView], epsilon: float) -> float:
    """The most requests in flight a replica may have after taking one more (bounded-load hashing)."""
    total = sum(view.load for view in replicas) + 1
    return math.ceil((1 + epsilon) * total / len(replicas))


def within_bound(replicas: Sequence[ReplicaView], epsilon: float) -> list[int]:
    """Indices of the replicas that may take one more request; never empty."""
    bound = load_bound(replicas, epsilon)
    allowed = [i for i, view in enumerate(replicas) if view.load + 1 <= bound]
    return allowed or [min(range(len(replicas)), key=lambda i: replicas[i].load)]


def rendezvous_rank(first_key: bytes, replica: int) -> bytes:
    """Highest-random-weight hashing: each (prefix, replica) pair gets a stable pseudo-random rank."""
    return hashlib.blake2b(first_key + replica.to_bytes(4, "little"), digest_size=8).digest()


def best_replica(request: RouteRequest, replicas: Sequence[ReplicaView], candidates: Sequence[int],
                 tier_weights: Mapping[str, float]) -> int:
    """The candidate saving the most prefill; ties go to the least loaded, then to the rendezvous winner."""
    return max(candidates, key=lambda i: (expected_saved_tokens(replicas[i], tier_weights), -replicas[i].load,
                                          rendezvous_rank(request.first_key, i)))


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        index = self._next % len(replicas)
        self._next = index + 1
        return index


class RandomChoice:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return self._rng.randrange(len(replicas))


class PrefixAffinity:
    def __init__(self, tier_weights: Mapping[str, float] | None = None) -> None:
        self.tier_weights = dict(tier_weights or {})

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return best_replica(request, replicas, range(len(replicas)), self.tier_weights)


class LoadBoundedAffinity:
    def __init__(self, epsilon: float = 0.25, tier_weights: Mapping[str, float] | None = None) -> None:
        if epsilon < 0:
            raise ConfigError(f"load epsilon must not be negative, got {epsilon}")
        self.epsilon = epsilon
        self.tier_weights = dict(tier_weights or {})

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return best_replica(request, replicas, within_bound(replicas, self.epsilon), self.tier_weights)


class StickySessions:
    """Keeps each session on one replica; ``max_sessions`` most recent sessions are remembered."""

    def __init__(self, inner: RoutingPolicy, epsilon: float = 0.25, max_sessions: int = 100_000) -> None:
        self.inner = inner
        self.epsilon = epsilon
        self.max_sessions = max_sessions
        self._homes: OrderedDict[str, int] = OrderedDict()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        session = request.session
        home = self._homes.get(session) if session is not None else None
        if home is not None and home < len(replicas) and home in within_bound(replicas, self.epsilon):
            self._homes.move_to_end(session)
            return home
        chosen = self.inner.choose(request, replicas)
        if session is not None:
            self._homes[session] = chosen
            self._homes.move_to_end(session)
            while len(self._homes) > self.max_sessions:
                self._homes.popitem(last=False)
        return chosen


class Routing(enum.Enum):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    PREFIX = "prefix"
    LOAD_BOUNDED = "load-bounded"


@dataclass(frozen=True)
class RoutingConfig:
    """``routing``: the policy; ``epsilon``: the load bound's slack; ``sticky``: keep sessions on one replica;
    ``tier_weights``: what a cached token of each tier is worth against one in the fastest (default 1.0)."""

    routing: Routing = Routing.LOAD_BOUNDED
    epsilon: float = 0.25
    sticky: bool = False
    tier_weights: tuple[tuple[str, float], ...] = ()
    seed: int = 0

    def build(self) -> RoutingPolicy:
        weights = dict(self.tier_weights)
        policy: RoutingPolicy = {
            Routing.ROUND_ROBIN: RoundRobin,
            Routing.RANDOM: lambda: RandomChoice(self.seed),
            Routing.PREFIX: lambda: PrefixAffinity(weights),
            Routing.LOAD_BOUNDED: lambda: LoadBoundedAffinity(self.epsilon, weights),
        }[self.routing]()
        return StickySessions(policy, self.epsilon) if self.sticky else policy
