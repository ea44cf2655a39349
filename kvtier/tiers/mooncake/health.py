"""The Mooncake tier's health: joining a pool whose master was not reachable at start, and probing the master
while the circuit breaker is open (a base class of MooncakeTier, as MooncakeControl is).

One daemon thread at most (kvtier.tiers.health_worker), started when the tier could not join or the breaker
opens; it ends once the tier is joined and the breaker closed, and is started again the next time either happens.
"""

from __future__ import annotations

import logging
from time import monotonic

from kvtier.base.errors import ConfigError, TierError
from kvtier.net.breaker import BreakerState
from kvtier.tiers.metrics import BREAKER_OPENS

log = logging.getLogger(__name__)


class MooncakeHealth:
    """Needs, from the tier: ``name``, ``config``, ``_metrics``, ``_client``, ``_breaker``, ``_health`` (a
    ``HealthWorker`` running ``_watch_turns``), ``_closed`` and ``_probe_key``."""

    def _breaker_changed(self, state: BreakerState) -> None:
        if state is BreakerState.OPEN:
            self._metrics.inc(BREAKER_OPENS, tier=self.name)
            log.warning("mooncake tier %s: master %s keeps failing; circuit open, probing every %.1fs", self.name,
                        self.config.master_address, self.config.breaker_cooldown_s)
            self._start_health()
        else:
            log.warning("mooncake tier %s: master %s answers again; circuit closed", self.name,
                        self.config.master_address)

    def _start_health(self) -> None:
        self._health.start()

    def _watch_turns(self) -> None:
        """Join the pool until joined, and probe the master while the breaker is open; then end."""
        cooldown = self.config.breaker_cooldown_s
        while not self._closed:
            self._health.wake.clear()
            if not self._client.joined:
                try:
                    joined = self._client.join(monotonic() + self.config.connect_timeout_s)
                except ConfigError as exc:  # e.g. no VRAM segments in this build: retrying cannot help
                    log.error("mooncake tier %s: cannot join the pool: %s", self.name, exc)
                    return
                wait = 0.0 if joined else cooldown
            elif self._breaker.state is BreakerState.OPEN:
                if self._breaker.probe_due() and self._probe():
                    self._breaker.success()
                wait = self._breaker.seconds_to_next_probe()
            else:
                if self._health.idle():
                    return
                continue
            self._health.wake.wait(max(0.01, wait))

    def _probe(self) -> bool:
        try:
            codes = self._client.exists([self._probe_key], monotonic() + self.config.timeout_s)
        except TierError:
            return False
        return all(code >= 0 for code in codes)
