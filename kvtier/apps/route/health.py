"""Which replicas take requests: active health checks, passive ejection, readmission.

* Active: every ``interval_s`` each replica is probed: kvtier replicas at ``/kvtier/info`` (which also tells
  the router when a replica restarted with new event endpoints), others at ``/health``. ``eject_after`` failed
  probes in a row eject a replica; an ejected one is readmitted after ``readmit_after`` good probes in a row.
* Ejection cuts short the requests waiting on the replica for their first byte: they are retried on another
  replica (kvtier.apps.route.proxy), not left to wait out the read timeout on one the router gave up on.
* Passive: ``passive_eject_after`` requests in a row that failed on a replica (it refused the connection,
  reset it, or answered 5xx) eject it at once, without waiting for the next probe.

Ejection stops the replica's event subscription; readmission fetches its info again and resubscribes (the
replica's snapshot then says what it holds: a replica with a disk tier comes back warm).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import httpx

from kvtier.apps.route.config import HealthConfig
from kvtier.apps.route.metrics import EJECTIONS, READMISSIONS
from kvtier.apps.route.replicas import Replica, ReplicaInfo
from kvtier.base.metrics import Metrics
from kvtier.events.wire import WireError

log = logging.getLogger(__name__)


class Health:
    """Probes ``replicas`` and flips their state; ``admitted(replica)`` runs for each replica that is up after a
    probe (to follow its events)."""

    def __init__(self, replicas: Sequence[Replica], config: HealthConfig, metrics: Metrics,
                 admitted: Callable[[Replica], None]) -> None:
        self.replicas, self.config, self.metrics, self._admitted = replicas, config, metrics, admitted
        self._kvtier: dict[str, bool] = {}  # replica name -> serves /kvtier/info (unknown until probed)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(replica) for replica in self.replicas))

    async def probe(self, replica: Replica) -> None:
        ok = await self._alive(replica)
        if ok:
            replica.failed_checks, replica.good_checks = 0, replica.good_checks + 1
            if not replica.up and replica.good_checks >= self.config.readmit_after:
                replica.readmit()
                replica.failed_requests = 0
                self.metrics.inc(READMISSIONS, replica=replica.name)
                log.warning("replica %s is healthy again: readmitted", replica.name)
            if replica.up:
                self._admitted(replica)
            return
        replica.good_checks, replica.failed_checks = 0, replica.failed_checks + 1
        if replica.up and replica.failed_checks >= self.config.eject_after:
            self.eject(replica, "active")

    def request_failed(self, replica: Replica) -> None:
        replica.failed_requests += 1
        if replica.up and replica.failed_requests >= self.config.passive_eject_after:
            self.eject(replica, "passive")

    def request_ok(self, replica: Replica) -> None:
        replica.failed_requests = 0

    def eject(self, replica: Replica, cause: str) -> None:
        replica.eject()
        replica.good_checks = 0
        replica.stop_events()
        self.metrics.inc(EJECTIONS, replica=replica.name, cause=cause)
        log.warning("replica %s ejected (%s)", replica.name, cause)

    async def _alive(self, replica: Replica) -> bool:
        timeout = self.config.timeout_s
        try:
            if self._kvtier.get(replica.name, True):
                response = await replica.client.get("/kvtier/info", timeout=timeout)
                if response.status_code == 200:
                    self._learn(replica, response.content)
                    return True
                if response.status_code != 404:
                    return False
                self._kvtier[replica.name] = False  # not kvtier serve: the router's own record it is
                replica.info = None
            response = await replica.client.get("/health", timeout=timeout)
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    def _learn(self, replica: Replica, body: bytes) -> None:
        try:
            replica.info = ReplicaInfo.from_json(body)
            self._kvtier[replica.name] = True
        except WireError as exc:
            log.warning("replica %s: unusable /kvtier/info (%s); using the router's own record", replica.name, exc)
            self._kvtier[replica.name] = False
            replica.info = None
