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

from kvtier.metrics import Metrics
from kvtier.tiers.redis import pipeline as net
from kvtier.net.breaker import BreakerState, CircuitBreaker
from kvtier.tiers.redis.resp import WireError

log = logging.getLogger(__name__)

#: Slot-map refreshes happen at most this often.
REFRESH_INTERVAL_S = 1.0


class Servers:
    def __init__(
        self,
        conn_class: type,
        conn_kwargs: dict[str, Any],
        *,
        cluster: bool,
        pool_size: int,
        timeout_s: float,
        connect_timeout_s: float,
        breaker_failures: int,
        breaker_cooldown_s: float,
        metrics: Metrics,
        name: str,
    ) -> None:
        self.name = name
        self.cluster = cluster
        self._conn_class, self._conn_kwargs = conn_class, conn_kwargs
        self._pool_size, self._timeout_s, self._connect_timeout_s = pool_size, timeout_s, connect_timeout_s
        self._breaker_failures, self._cooldown_s = breaker_failures, breaker_cooldown_s
        self._metrics = metrics
        self._lock = threading.Lock()
        self._nodes: dict[str, net.Node] = {}
        self.seed = self.node(conn_kwargs.get("host"), conn_kwargs.get("port"))
        self._slots: list[net.Node | None] | None = None
        self._stale = cluster
        self._last_refresh = float("-inf")
        self._worker: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False
        metrics.add_gauges(self._gauges)
        if cluster:
            self._refresh_slots()

    # -- nodes and routing ---------------------------------------------------------------------------------
    def node(self, host: str | None, port: int | None) -> net.Node:
        kwargs = dict(self._conn_kwargs)
        if host is not None:
            kwargs["host"], kwargs["port"] = host, port
        name = kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                breaker = CircuitBreaker(self._breaker_failures, self._cooldown_s,
                                         on_change=lambda state: self._breaker_changed(name, state))
                node = net.Node(name, lambda: self._conn_class(**kwargs), self._pool_size, self._connect_timeout_s,
                                breaker)
                self._nodes[name] = node
        return node

    def batch(self, batches: dict[str, net.Batch], head: bytes) -> net.Batch:
        """The batch (one per node) that ``head`` and the keys sharing its hash tag go into."""
        slots = self._slots
        node = self.seed
        if slots is not None:
            node = slots[net.key_slot(head)] or self.seed
        batch = batches.get(node.name)
        if batch is None:
            batch = batches[node.name] = net.Batch(node)
        return batch

    def group(self, heads: list[bytes]) -> dict[net.Node, tuple[list[int], list[bytes]]]:
        """Heads by the node that owns them, with their indices."""
        slots = self._slots
        if slots is None:
            return {self.seed: (list(range(len(heads))), heads)}
        groups: dict[net.Node, tuple[list[int], list[bytes]]] = {}
        slot_of = net.key_slot
        for i, head in enumerate(heads):
            node = slots[slot_of(head)] or self.seed
            group = groups.get(node)
            if group is None:
                group = groups[node] = ([], [])
            group[0].append(i)
            group[1].append(head)
        return groups

    def primaries(self) -> list[net.Node]:
        slots = self._slots
        if slots is None:
            return [self.seed]
        return list({node.name: node for node in slots if node is not None}.values())

    def run(self, batches: dict[str, net.Batch], op: str, deadline: float, rate: float = 0.0) -> list[net.Batch]:
        """Run the batches; return those that got replies. Failures are counted and logged here."""
        todo = list(batches.values())
        if not todo:
            return []
        net.run(todo, deadline, rate)
        done = []
        for batch in todo:
            if batch.error is None:
                done.append(batch)
                if self.cluster and any(net.is_redirect(r) for r in batch.replies or ()):
                    self._mark_stale()
            elif isinstance(batch.error, net.BreakerOpen):
                self._metrics.inc("kvtier_breaker_rejected_total", tier=self.name, op=op)
            else:
                self._metrics.inc("kvtier_tier_errors_total", tier=self.name, op=op)
                log.warning("redis tier %s: %s on %s failed: %s", self.name, op, batch.node.name, batch.error)
                if self.cluster:
                    self._mark_stale()
        return done

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()

    # -- health: breakers, the background worker, the slot map ----------------------------------------------
    def _breaker_changed(self, node: str, state: BreakerState) -> None:
        if state is BreakerState.OPEN:
            self._metrics.inc("kvtier_breaker_opens_total", tier=self.name)
            log.warning("redis tier %s: %s keeps failing; circuit open, probing every %.1fs", self.name, node,
                        self._cooldown_s)
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
        with self._lock:
            self._wake.set()
            if self._closed or (self._worker is not None and self._worker.is_alive()):
                return
            self._worker = threading.Thread(target=self._work, name=f"kvtier-{self.name}-health", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        """Probe open breakers and refresh the slot map, until there is nothing left to do."""
        while not self._closed:
            self._wake.clear()
            with self._lock:
                nodes = list(self._nodes.values())
            for node in nodes:
                if node.breaker.probe_due() and node.probe(self._timeout_s):
                    node.breaker.success()
            if self._stale and monotonic() - self._last_refresh >= REFRESH_INTERVAL_S:
                self._refresh_slots()
            waits = [n.breaker.seconds_to_next_probe() for n in nodes if n.breaker.state is BreakerState.OPEN]
            if self._stale:
                waits.append(max(0.05, self._last_refresh + REFRESH_INTERVAL_S - monotonic()))
            if not waits:
                with self._lock:
                    if not self._wake.is_set():
                        self._worker = None
                        return
                continue
            self._wake.wait(max(0.01, min(waits)))

    def _refresh_slots(self) -> None:
        """Read the slot map (CLUSTER SLOTS) from the seed or any known node that answers."""
        self._last_refresh = monotonic()
        with self._lock:
            candidates = [self.seed] + [n for n in self._nodes.values() if n is not self.seed]
        seed_host = str(self._conn_kwargs.get("host", "127.0.0.1"))
        for node in candidates:
            if not node.breaker.allow():
                continue
            batch = net.Batch(node)
            batch.add(None, b"CLUSTER", b"SLOTS")
            net.run([batch], monotonic() + self._timeout_s, 0.0)
            if batch.error is not None or not batch.replies:
                continue
            try:
                ranges = net.parse_cluster_slots(batch.replies[0], seed_host)
            except WireError as exc:
                log.warning("redis tier %s: %s", self.name, exc)
                continue
            slots: list[net.Node | None] = [None] * net.CLUSTER_SLOTS
            for first, last, host, port in ranges:
                owner = self.node(host, port)
                for slot in range(max(first, 0), min(last, net.CLUSTER_SLOTS - 1) + 1):
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
            yield "kvtier_breaker_open", {"tier": self.name, "node": node.name}, float(node.breaker.state)
