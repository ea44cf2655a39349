"""Session placement that needs no shared state: rendezvous hashing of the session id over the replicas.

Several routers (``kvtier route --workers N``, or instances behind a load balancer) each see only some of a
session's requests. ``RendezvousSessions`` sends a session to the replica ranked first by
``rendezvous_rank(session, replica name)`` that is within the load bound (kvtier.fleet.scoring): every router
computes the same ranking from the session id and the replica names alone, so all of them send a session to
the same replica without telling each other anything, and a replica that leaves moves only its own sessions
(to their second-ranked replica). Load breaks the tie only past the bound, as it does for remembered sessions.
Requests without a session go to the inner policy (cache-aware, load-bounded).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.fleet.scoring import (
    Decision,
    Reason,
    ReplicaView,
    RouteRequest,
    RoutingPolicy,
    rendezvous_rank,
    replica_name,
    within_bound,
)


class RendezvousSessions:
    """A session's requests to its rendezvous home among the replicas within the load bound (``epsilon``,
    ``load_floor``, as the load-bounded policy's); ``breaks`` counts requests whose first-ranked replica was
    above the bound."""

    def __init__(self, inner: RoutingPolicy, epsilon: float = 0.25, load_floor: int = 2) -> None:
        self.inner, self.epsilon, self.load_floor = inner, epsilon, load_floor
        self.breaks = 0

    def decide(self, request: RouteRequest, replicas: Sequence[ReplicaView],
               candidates: Sequence[int] | None = None) -> Decision:
        if request.session is None:
            return self.inner.decide(request, replicas, candidates)
        key = request.session.encode()
        ranked = sorted(range(len(replicas)), key=lambda i: rendezvous_rank(key, replica_name(replicas, i)),
                        reverse=True)
        allowed = set(within_bound(replicas, self.epsilon, self.load_floor))
        chosen = next((i for i in ranked if i in allowed), ranked[0])
        if chosen != ranked[0]:
            self.breaks += 1
            return Decision(chosen, Reason.STICKY_BREAK)
        return Decision(chosen, Reason.STICKY)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return self.decide(request, replicas).replica
