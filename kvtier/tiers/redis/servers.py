"""The servers behind one Redis tier: routing, health and the background worker.

* One ``Node`` per server (the URL's server; with Redis Cluster, each primary from ``CLUSTER SLOTS``), each with
  its own connection pool and circuit breaker.
* Routing: a key goes to the owner of its hash slot (the slot of its ``{hash tag}``), so a request's chunks are
  grouped into one pipeline per shard.
* A background worker, started only when needed, probes the nodes whose breakers are open (PING every
  cool-down; the breaker closes on the first answer) and refreshes the slot map after MOVED/ASK replies or a
  node failure. Requests never wait for either.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from time import monotonic
from typing import Any

from kvtier.base.metrics import Metrics
from kvtier.net.breaker import BreakerState, CircuitBreaker
from kvtier.tiers.health_worker import HealthWorker
from kvtier.tiers.metrics import BREAKER_OPEN, BREAKER_OPENS, BREAKER_REJECTED, TIER_ERRORS
from kvtier.tiers.redis.batches import Batch, is_redirect, probe, run_batches
from kvtier.tiers.redis.client import Endpoint, key_slot_function
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.redis.pool import BreakerOpen, Node
from kvtier.tiers.redis.resp import WireClosed, WireError

log = logging.getLogger(__name__)

#: Slot-map refreshes happen at most this often.
REFRESH_INTERVAL_S = 1.0
CLUSTER_SLOTS = 16384


class Servers:
    """The nodes of one Redis tier, the routing of keys to them and their health; ``run`` executes batches."""

    def __init__(self, endpoint: Endpoint, config: RedisTierConfig, metrics: Metrics, name: str) -> None:
        self.name = name
        self.cluster = config.cluster
        self._config = config
        self._metrics = metrics
        self._lock = threading.Lock()
        self._nodes: dict[str, Node] = {}
        self.seed = self._node(endpoint)
        self._slot_of = key_slot_function()
        self._slots: list[Node | None] | None = None
        self._stale = config.cluster
        self._last_refresh = float("-inf")
        self._closed = False
        self._health = HealthWorker(f"kvtier-{name}-health", self._work_turns, self._lock, lambda: self._closed,
                                    f"redis tier {name}")
        metrics.add_gauges(self._gauges)
        if config.cluster:
            self._refresh_slots()

    # -- nodes and routing ---------------------------------------------------------------------------------
    def _node(self, endpoint: Endpoint) -> Node:
        """The node of ``endpoint``, made on first use (with its own pool and breaker)."""
        name = endpoint.name
        config = self._config
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s,
                                         on_change=lambda state: self._breaker_changed(name, state))
                node = self._nodes[name] = Node(endpoint, config.pool_size, config.connect_timeout_s, breaker)
        return node

    def batch(self, batches: dict[str, Batch], head: bytes) -> Batch:
        """The batch (one per node) that ``head`` and the keys sharing its hash tag go into."""
        slots = self._slots
        node = self.seed
        if slots is not None:
            node = slots[self._slot_of(head)] or self.seed
        batch = batches.get(node.name)
        if batch is None:
            batch = batches[node.name] = Batch(node)
        return batch

    def group(self, heads: list[bytes]) -> dict[Node, tuple[list[int], list[bytes]]]:
        """Heads by the node that owns them, with their indices."""
        slots = self._slots
        if slots is None:
            return {self.seed: (list(range(len(heads))), heads)}
        groups: dict[Node, tuple[list[int], list[bytes]]] = {}
        slot_of = self._slot_of
        for i, head in enumerate(heads):
            node = slots[slot_of(head)] or self.seed
            group = groups.get(node)
            if group is None:
                group = groups[node] = ([], [])
            group[0].append(i)
            group[1].append(head)
        return groups

    def primaries(self) -> list[Node]:
        slots = self._slots
        if slots is None:
            return [self.seed]
        return list({node.name: node for node in slots if node is not None}.values())

    def run(self, batches: dict[str, Batch], op: str, deadline: float, rate: float = 0.0) -> list[Batch]:
        """Run the batches; return those that got replies. Failures are counted and logged here."""
        todo = list(batches.values())
        if not todo:
            return []
        run_batches(todo, deadline, rate)
        done = []
        for batch in todo:
            if batch.error is None:
                done.append(batch)
                if self.cluster and any(is_redirect(r) for r in batch.replies or ()):
                    self._mark_stale()
            elif isinstance(batch.error, BreakerOpen):
                self._metrics.inc(BREAKER_REJECTED, tier=self.name, op=op)
            else:
                self._metrics.inc(TIER_ERRORS, tier=self.name, op=op)
                log.warning("redis tier %s: %s on %s failed: %s", self.name, op, batch.node.name, batch.error)
                if self.cluster:
                    self._mark_stale()
        return done

    def close(self) -> None:
        self._closed = True
        self._health.wake.set()
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()

    # -- health: breakers, the background worker, the slot map ----------------------------------------------
    def _breaker_changed(self, node: str, state: BreakerState) -> None:
        if state is BreakerState.OPEN:
            self._metrics.inc(BREAKER_OPENS, tier=self.name)
            log.warning("redis tier %s: %s keeps failing; circuit open, probing every %.1fs", self.name, node,
                        self._config.breaker_cooldown_s)
            if self.cluster:
                self._stale = True
            self._start_worker()
        else:
            log.warning("redis tier %s: %s answers again; circuit closed", self.name, node)

    def _mark_stale(self) -> None:
        if not self._stale:
            self._stale = True
            self._start_worker()

    def _start_worker(self) -> None:
        self._health.start()

    def _work_turns(self) -> None:
        """Probe open breakers and refresh the slot map, until there is nothing left to do (the health thread's
        work: kvtier.tiers.health_worker)."""
        while not self._closed:
            self._health.wake.clear()
            with self._lock:
                nodes = list(self._nodes.values())
            for node in nodes:
                if node.breaker.probe_due() and probe(node, self._config.timeout_s):
                    node.breaker.success()
            if self._stale and monotonic() - self._last_refresh >= REFRESH_INTERVAL_S:
                self._refresh_slots()
            waits = [n.breaker.seconds_to_next_probe() for n in nodes if n.breaker.state is BreakerState.OPEN]
            if self._stale:
                waits.append(max(0.05, self._last_refresh + REFRESH_INTERVAL_S - monotonic()))
            if not waits:
                if self._health.idle():
                    return
                continue
            self._health.wake.wait(max(0.01, min(waits)))

    def _refresh_slots(self) -> None:
        """Read the slot map (CLUSTER SLOTS) from the seed or any known node that answers."""
        self._last_refresh = monotonic()
        with self._lock:
            candidates = [self.seed] + [n for n in self._nodes.values() if n is not self.seed]
        seed_host = self.seed.endpoint.host
        for node in candidates:
            if not node.breaker.allow():
                continue
            batch = Batch(node)
            batch.add(None, b"CLUSTER", b"SLOTS")
            run_batches([batch], monotonic() + self._config.timeout_s, 0.0)
            if batch.error is not None or not batch.replies:
                continue
            try:
                ranges = parse_cluster_slots(batch.replies[0], seed_host)
            except WireError as exc:
                log.warning("redis tier %s: %s", self.name, exc)
                continue
            slots: list[Node | None] = [None] * CLUSTER_SLOTS
            for first, last, host, port in ranges:
                owner = self._node(self.seed.endpoint.at(host, port))
                for slot in range(max(first, 0), min(last, CLUSTER_SLOTS - 1) + 1):
                    slots[slot] = owner
            self._slots = slots
            self._stale = False
            return
        log.warning("redis tier %s: cannot read the cluster slot map yet; will retry", self.name)
        self._stale = True
        self._start_worker()

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            yield BREAKER_OPEN.name, {"tier": self.name, "node": node.name}, float(node.breaker.state)


def parse_cluster_slots(reply: Any, seed_host: str) -> list[tuple[int, int, str, int]]:
    """``CLUSTER SLOTS`` -> [(first_slot, last_slot, primary_host, primary_port)]."""
    if not isinstance(reply, list):
        raise WireClosed(f"unexpected CLUSTER SLOTS reply: {reply!r}"[:200])
    ranges = []
    for entry in reply:
        try:
            first, last, primary = int(entry[0]), int(entry[1]), entry[2]
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            port = int(primary[1])
        except (IndexError, TypeError, ValueError, AttributeError):
            raise WireClosed("malformed CLUSTER SLOTS reply") from None
        if host in ("", "?"):
            host = seed_host
        ranges.append((first, last, host, port))
    return ranges
