"""Which replica should serve a request: pure decisions over the router's view of the fleet.

The view of one replica for one request is a ``ReplicaView``: how many tokens of the request's prefix the
replica holds, per tier (each chunk counted once, in the fastest tier holding it; a chunk in a shared store
the replica reads counts under that store's tier), and its load: requests in flight, and of those the prompt
tokens still to prefill and the streams already decoding. Every ``RoutingPolicy`` turns a request and the
views into a ``Decision``: a replica index and the reason for it. ``kvtier sim`` and ``kvtier route`` import
this one module, so what the simulator predicts is what the router does.

Cost of a replica for a request, in prefill tokens::

    prompt tokens - sum(cached tokens x tier weight)        # what it would compute for this request
      + prefill tokens in flight                             # what it must compute first
      + decode streams x decode_stream_tokens                # what its running generations cost it

Tier weights say what a cached token is worth against one in the fastest tier (RAM 1.0; a slower tier
less: its load is not free), so a prefix in RAM beats the same prefix on disk.

Policies:

* ``RoundRobin`` and ``RandomChoice``: ignore the cache (baselines).
* ``PrefixAffinity``: the cheapest replica.
* ``LoadBoundedAffinity``: the same, among replicas within the load bound of consistent hashing with
  bounded loads (Mirrokni et al., 2018): a replica may take the request only if its in-flight requests, plus
  this one, stay within ``max(ceil((1 + epsilon) x (all in flight + 1) / replicas), load_floor)``. No replica
  runs far above the mean while the others idle, whatever the prefix sharing. The floor (2 by default): with
  one request in flight of three replicas the bound alone is 1, and a session whose replica serves one other
  request would break away and recompute its context rather than wait behind it (engines batch requests).
* ``StickySessions``: a session's later requests go back to the replica that served its last one, unless
  that replica is above the load bound (or gone); then an inner policy chooses and the break is counted.
  A session without a home (a new one, or a break) is placed by the inner policy among the replicas within
  the *session bound*: a replica may home one more session only if its homed sessions, plus this one, stay
  within ``max((1 + session_epsilon) x m, ceil(m))``, ``m = (all homed sessions + 1) / replicas`` (sessions
  counted among the remembered ones, on the replicas present): a relative slack for many sessions, where new
  sessions sharing long prefixes keep their hits, and no more than an even share (rounded up) for a few.
  Without it a prefix every conversation starts with (a shared system prompt), cached first on one replica,
  makes that replica the cheapest for every new session, and stickiness keeps them all there while the
  in-flight bound does not bind (one or two requests in flight): the fleet herds. Among replicas that cost
  the same (all holding the system prompt), the one homing fewest sessions takes a new one. A prefix that
  only one replica holds still draws a new session there while that replica is within the session bound;
  requests without a session are not bounded by it. When the in-flight bound and the session bound leave
  no replica in common, the in-flight bound wins. A replica that joins homes
  nothing, so new sessions go to it (within the in-flight bound) until it catches up with the others.

Ties (no replica holds anything, or several cost the same) are broken by load, then by sessions homed (a new
sticky session), then by rendezvous hashing of the request's first chunk key and the replica's name, so a new
prefix has a stable home from its first request on, whichever replicas are up (``TieBreak.HOME``). With
``TieBreak.RANDOM`` the last step is a seeded random draw instead, as llm-d's max-score picker shuffles its
candidates: prompts that share only a first block (a system prompt) then spread instead of meeting on one home.
The draw hashes the seed with the request's ``draw_key`` (a digest of its prompt, kvtier.fleet.draws), so a
replay of the same requests draws the same; a request without one draws from the seeded generator.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.base.errors import ConfigError
from kvtier.fleet.draws import draw_rank


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica for one request."""

    #: tokens of the request's prefix the replica holds, by tier name (each chunk in its fastest tier)
    cached: Mapping[str, int] = field(default_factory=dict)
    #: requests in flight on the replica
    load: float = 0.0
    #: prompt tokens of in-flight requests the replica has yet to compute (the router's own accounting)
    prefill_tokens: int = 0
    #: in-flight requests past their first token
    decode_streams: int = 0
    #: a stable name (sessions and rendezvous homes follow it when the list of replicas changes); "" = index
    name: str = ""
    #: sessions homed on the replica (filled in by ``StickySessions`` for a session without a home)
    sessions: int = 0


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request before choosing."""

    prompt_tokens: int
    #: the key of the prompt's first chunk (b"" for a prompt shorter than a chunk): the tie-breaker's input
    first_key: bytes = b""
    #: a conversation or client id, for sticky sessions
    session: str | None = None
    #: what a random tie-break draws from (kvtier.fleet.draws.prompt_digest); b"": a draw from the generator
    draw_key: bytes = b""


class Reason(enum.Enum):
    """Why a replica was chosen (the router counts decisions by reason)."""

    CACHED = "cached"  #: the cheapest replica, and it holds part of the prompt
    SPREAD = "spread"  #: no replica holds any of the prompt: least loaded, then the rendezvous home
    BOUND = "bound"  #: a replica holding more of the prompt was above the load bound
    BALANCE = "balance"  #: a new session: a replica holding more of the prompt homed too many sessions
    STICKY = "sticky"  #: the session's last replica
    STICKY_BREAK = "sticky-break"  #: the session's last replica was above the bound or gone
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: Reason


class RoutingPolicy(Protocol):
    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               candidates: Sequence[int] | None = None) -> Decision:
        """The replica (an index into ``replicas``, never empty) that serves ``request``, and why; with
        ``candidates`` (indices, never empty), one of them unless a policy's own load bound rules them all out."""

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        """``decide(...).replica``."""


def expected_saved_tokens(view: ReplicaView, tier_weights: Mapping[str, float]) -> float:
    """Prefill tokens the replica is expected to save: cached tokens, weighted by tier (1.0 when unnamed)."""
    return sum(tokens * tier_weights.get(tier, 1.0) for tier, tokens in view.cached.items())


def prefill_cost(request: RouteRequest, view: ReplicaView, tier_weights: Mapping[str, float],
                 decode_stream_tokens: float = 0.0) -> float:
    """The replica's cost for ``request`` in prefill tokens (see the module docstring)."""
    compute = max(request.prompt_tokens - expected_saved_tokens(view, tier_weights), 0.0)
    return compute + view.prefill_tokens + decode_stream_tokens * view.decode_streams


def load_bound(replicas: Sequence[ReplicaView], epsilon: float, floor: int = 1) -> float:
    """The most requests in flight a replica may have after taking one more (bounded-load hashing), and never
    fewer than ``floor``."""
    total = sum(view.load for view in replicas) + 1
    return max(math.ceil((1 + epsilon) * total / len(replicas)), floor)


def within_bound(replicas: Sequence[ReplicaView], epsilon: float, floor: int = 1) -> list[int]:
    """Indices of the replicas that may take one more request; never empty."""
    bound = load_bound(replicas, epsilon, floor)
    allowed = [i for i, view in enumerate(replicas) if view.load + 1 <= bound]
    return allowed or [min(range(len(replicas)), key=lambda i: replicas[i].load)]


def replica_name(replicas: Sequence[ReplicaView], i: int) -> str:
    return replicas[i].name or str(i)


def rendezvous_rank(first_key: bytes, replica: str) -> bytes:
    """Highest-random-weight hashing: each (prefix, replica) pair gets a stable pseudo-random rank."""
    return hashlib.blake2b(first_key + b"\0" + replica.encode(), digest_size=8).digest()


class TieBreak(enum.Enum):
    """The last tie-break between replicas that cost the same (module docstring)."""

    HOME = "home"  #: the rendezvous home of the prompt's first key: stable, so a new prefix has one home
    RANDOM = "random"  #: a seeded random draw (llm-d's max-score picker): equal prompts spread


@dataclass(frozen=True)
class CostModel:
    """How a policy prices replicas: tier weights, what one decoding stream costs in prefill tokens, and the
    last tie-break (``tie_rng`` None: ``TieBreak.HOME``; else ``TieBreak.RANDOM``: the hash of ``tie_seed``
    and the request's ``draw_key``, or a draw from ``tie_rng`` for a request without one)."""

    tier_weights: Mapping[str, float] = field(default_factory=dict)
    decode_stream_tokens: float = 0.0
    tie_rng: random.Random | None = None
    tie_seed: bytes = b""

    def best(self, request: RouteRequest, replicas: Sequence[ReplicaView], candidates: Sequence[int]) -> int:
        """The cheapest candidate; ties go to the one saving more, the least loaded, the one homing fewest
        sessions, the rendezvous winner (or a random one)."""
        draw = None if self.tie_rng is None else request.draw_key or self.tie_rng.randbytes(16)

        def rank(i: int):
            view = replicas[i]
            name = replica_name(replicas, i)
            last = rendezvous_rank(request.first_key, name) if draw is None else draw_rank(self.tie_seed, draw, name)
            return (-prefill_cost(request, view, self.tier_weights, self.decode_stream_tokens),
                    expected_saved_tokens(view, self.tier_weights), -view.load, -view.sessions, last)

        return max(candidates, key=rank)

    def saved(self, view: ReplicaView) -> float:
        return expected_saved_tokens(view, self.tier_weights)


def cost_model(tier_weights: Mapping[str, float] | None, decode_stream_tokens: float,
               tie_rng: random.Random | None) -> CostModel:
    seed = tie_rng.randbytes(8) if tie_rng is not None else b""  # keyed draws: the generator's first 8 bytes
    return CostModel(dict(tier_weights or {}), decode_stream_tokens, tie_rng, seed)


class _Policy:
    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               candidates: Sequence[int] | None = None) -> Decision:
        raise NotImplementedError

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return self.decide(request, replicas).replica


class RoundRobin(_Policy):
    def __init__(self) -> None:
        self._next = 0

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               candidates: Sequence[int] | None = None) -> Decision:
        index = self._next % len(replicas)
        self._next = index + 1
        if candidates is not None and index not in candidates:  # the next candidate after it, in turn
            index = min(candidates, key=lambda i: (i - index) % len(replicas))
        return Decision(index, Reason.ROUND_ROBIN)


class RandomChoice(_Policy):
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               candidates: Sequence[int] | None = None) -> Decision:
        pool = list(range(len(replicas))) if candidates is None else list(candidates)
        return Decision(pool[self._rng.randrange(len(pool))], Reason.RANDOM)


class PrefixAffinity(_Policy):
    def __init__(self, tier_weights: Mapping[str, float] | None = None, decode_stream_tokens: float = 0.0,
                 tie_rng: random.Random | None = None) -> None:
        self.cost = cost_model(tier_weights, decode_stream_tokens, tie_rng)
        self.tier_weights = self.cost.tier_weights

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               candidates: Sequence[int] | None = None) -> Decision:
        best = self.cost.best(request, replicas, range(len(replicas)) if candidates is None else candidates)
        return _explain(self.cost, replicas, best, Reason.BALANCE)


def _check_bound(epsilon: float, floor: int) -> None:
    if epsilon < 0:
        raise ConfigError(f"load epsilon must not be negative, got {epsilon}")
    if floor < 1:
        raise ConfigError(f"the load floor must be at least 1 request in flight, got {floor}")


class LoadBoundedAffinity(_Policy):
    def __init__(self, epsilon: float = 0.25, tier_weights: Mapping[str, float] | None = None,
                 decode_stream_tokens: float = 0.0, tie_rng: random.Random | None = None,
                 load_floor: int = 2) -> None:
        _check_bound(epsilon, load_floor)
        self.epsilon = epsilon
        self.load_floor = load_floor
        self.cost = cost_model(tier_weights, decode_stream_tokens, tie_rng)
        self.tier_weights = self.cost.tier_weights

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               candidates: Sequence[int] | None = None) -> Decision:
        allowed = within_bound(replicas, self.epsilon, self.load_floor)
        pool = allowed if candidates is None else [i for i in allowed if i in candidates] or allowed
        chosen = self.cost.best(request, replicas, pool)
        if self.cost.saved(replicas[chosen]) < max(self.cost.saved(replicas[i]) for i in allowed):
            return Decision(chosen, Reason.BALANCE)
        return _explain(self.cost, replicas, chosen, Reason.BOUND)


def _explain(cost: CostModel, replicas: Sequence[ReplicaView], chosen: int, narrowed: Reason) -> Decision:
    """Why ``chosen``: ``narrowed`` when a replica not considered holds more of the prompt."""
    saved = cost.saved(replicas[chosen])
    if saved < max(cost.saved(view) for view in replicas):
        return Decision(chosen, narrowed)
    return Decision(chosen, Reason.CACHED if saved > 0 else Reason.SPREAD)


class StickySessions(_Policy):
    """Keeps each session on one replica; the ``max_sessions`` most recent sessions are remembered (the router
    passes fixed-size digests as sessions, so the table's memory is bounded by its count).

    ``breaks`` counts requests whose session had a replica that could not take them (above the bound, or no
    longer among the replicas). A session without a home is placed within the session bound (module
    docstring); ``session_epsilon`` is its relative slack; ``epsilon`` and ``load_floor`` make the load bound."""

    def __init__(self, inner: RoutingPolicy, epsilon: float = 0.25, max_sessions: int = 100_000,
                 session_epsilon: float = 0.25, load_floor: int = 2) -> None:
        if session_epsilon < 0:
            raise ConfigError(f"session epsilon must not be negative, got {session_epsilon}")
        _check_bound(epsilon, load_floor)
        self.inner = inner
        self.epsilon = epsilon
        self.load_floor = load_floor
        self.session_epsilon = session_epsilon
        self.max_sessions = max_sessions
        self.breaks = 0
        self._homes: OrderedDict[str, str] = OrderedDict()
        self._homed: dict[str, int] = {}  # replica name -> remembered sessions homed there

    def homed(self, replica: str) -> int:
        """Remembered sessions whose home is ``replica``."""
        return self._homed.get(replica, 0)

    def within_session_bound(self, replicas: Sequence[ReplicaView]) -> list[int]:
        """Indices of the replicas that may home one more session; never empty."""
        counts = [self.homed(replica_name(replicas, i)) for i in range(len(replicas))]
        mean = (sum(counts) + 1) / len(replicas)
        bound = max((1 + self.session_epsilon) * mean, math.ceil(mean))
        allowed = [i for i, count in enumerate(counts) if count + 1 <= bound]
        return allowed or [min(range(len(replicas)), key=counts.__getitem__)]

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> Decision:
        session = request.session
        home = self._homes.get(session) if session is not None else None
        if home is not None:
            index = next((i for i in range(len(replicas)) if replica_name(replicas, i) == home), None)
            if index is not None and index in within_bound(replicas, self.epsilon, self.load_floor):
                self._homes.move_to_end(session)
                return Decision(index, Reason.STICKY)
            self.breaks += 1
        candidates = None
        if session is not None:
            candidates = self.within_session_bound(replicas)
            replicas = [dataclasses.replace(view, sessions=self.homed(replica_name(replicas, i)))
                        for i, view in enumerate(replicas)]
        decision = self.inner.decide(request, replicas, candidates)
        if session is not None:
            self.remember(session, replica_name(replicas, decision.replica))
        return Decision(decision.replica, Reason.STICKY_BREAK) if home is not None else decision

    def remember(self, session: str, replica: str) -> None:
        """``session`` was served by ``replica`` (a retry may serve it elsewhere than decided)."""
        old = self._homes.get(session)
        if old != replica:
            if old is not None:
                self._unhome(old)
            self._homed[replica] = self._homed.get(replica, 0) + 1
        self._homes[session] = replica
        self._homes.move_to_end(session)
        while len(self._homes) > self.max_sessions:
            self._unhome(self._homes.popitem(last=False)[1])

    def _unhome(self, replica: str) -> None:
        left = self._homed[replica] - 1
        if left:
            self._homed[replica] = left
        else:
            del self._homed[replica]


class Routing(enum.Enum):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    PREFIX = "prefix"
    LOAD_BOUNDED = "load-bounded"


@dataclass(frozen=True)
class RoutingConfig:
    """``routing``: the policy; ``epsilon``: the load bound's slack; ``sticky``: keep sessions on one replica;
    ``tier_weights``: what a cached token of each tier is worth against one in the fastest (default 1.0);
    ``decode_stream_tokens``: what one decoding request costs a replica, in prefill tokens; ``max_sessions``:
    the sticky sessions remembered (least recently used forgotten first); ``session_epsilon``: the session
    bound's slack (sticky only); ``load_floor``: the load bound never holds a replica below this many requests
    in flight (module docstring); ``tie_break``: the last tie-break of the affinity policies (``seed`` seeds a
    random one)."""

    routing: Routing = Routing.LOAD_BOUNDED
    epsilon: float = 0.25
    sticky: bool = False
    tier_weights: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    decode_stream_tokens: float = 0.0
    max_sessions: int = 100_000
    session_epsilon: float = 0.25
    tie_break: TieBreak = TieBreak.HOME
    load_floor: int = 2

    def build(self) -> RoutingPolicy:
        weights = dict(self.tier_weights)
        rng = random.Random(self.seed) if self.tie_break is TieBreak.RANDOM else None
        policy: RoutingPolicy = {
            Routing.ROUND_ROBIN: RoundRobin,
            Routing.RANDOM: lambda: RandomChoice(self.seed),
            Routing.PREFIX: lambda: PrefixAffinity(weights, self.decode_stream_tokens, rng),
            Routing.LOAD_BOUNDED: lambda: LoadBoundedAffinity(self.epsilon, weights, self.decode_stream_tokens, rng,
                                                            self.load_floor),
        }[self.routing]()
        if not self.sticky:
            return policy
        return StickySessions(policy, self.epsilon, self.max_sessions, self.session_epsilon, self.load_floor)
