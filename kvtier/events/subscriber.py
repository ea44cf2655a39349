"""Follow one replica's event stream (asyncio): snapshot first, then batches in order, snapshot again on a gap.

The subscriber keeps a ``ReplicaHoldings`` (what the replica holds, per tier) in step with the replica:

* at start, after a restart of the replica (a new epoch) and after a lost batch (a gap in ``seq``), it asks
  the replica's control socket for a snapshot and replaces what it knew; batches the snapshot already
  reflects (``seq`` <= the snapshot's) are skipped, later ones applied in order;
* every ``resync_s`` it takes a snapshot anyway, which bounds the damage of the rare reordering a stream can
  have (see kvtier.events.model);
* a message that does not decode is counted and dropped (then the next batch shows a gap).

The replica's silence is not this module's business: the router's health checks eject a dead replica and
restart its subscriber when it comes back (its endpoints may have changed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from kvtier.events.wire import SNAPSHOT_REQUEST, Batch, Snapshot, WireError, decode_batch, decode_snapshot

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20  # a snapshot of ~8M keys; anything larger is refused by ZMQ itself


class HoldingsSink(Protocol):
    """What a subscriber keeps up to date (the router's index of one replica)."""

    def reset(self, snapshot: Snapshot) -> None: ...

    def apply(self, batch: Batch) -> None: ...


@dataclass(frozen=True)
class SubscriberConfig:
    snapshot_timeout_s: float = 5.0
    resync_s: float = 300.0
    retry_s: float = 1.0


class EventSubscriber:
    """``run()`` follows the stream until cancelled; ``count(what)`` is told of snapshots, batches, errors."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, control_endpoint: str, sink: HoldingsSink,
                 config: SubscriberConfig = SubscriberConfig(), count: Callable[[str], None] = lambda what: None
                 ) -> None:
        self._ctx, self._endpoint, self._control_endpoint = ctx, endpoint, control_endpoint
        self._sink, self._config, self._count = sink, config, count
        self.epoch: str | None = None
        self.seq = -1
        self._synced_at = 0.0

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.connect(self._endpoint)
        sub.subscribe(b"")
        try:
            while self.epoch is None:
                if not await self._resync():
                    await asyncio.sleep(self._config.retry_s)
            while True:
                frames = await sub.recv_multipart()
                self._receive(frames)
                if self.epoch is None or time.monotonic() - self._synced_at > self._config.resync_s:
                    await self._resync()
        finally:
            sub.close(linger=0)

    def _receive(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise WireError(f"expected 3 frames, got {len(frames)}")
            batch = decode_batch(frames[2])
        except WireError as exc:
            self._count("malformed")
            log.warning("event stream %s: dropped a message: %s", self._endpoint, exc)
            return
        if batch.epoch == self.epoch and batch.seq <= self.seq:
            return  # already in the snapshot
        if batch.epoch != self.epoch or batch.seq != self.seq + 1:
            self._count("gap" if batch.epoch == self.epoch else "new_epoch")
            self.epoch = None  # the caller resynchronises; this batch is in the snapshot it gets
            return
        self._sink.apply(batch)
        self.seq = batch.seq
        self._count("batch")

    async def _resync(self) -> bool:
        """Ask for a snapshot and adopt it; False if the replica did not answer in time."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.connect(self._control_endpoint)
        try:
            await dealer.send_multipart([SNAPSHOT_REQUEST])
            frames = await asyncio.wait_for(dealer.recv_multipart(), self._config.snapshot_timeout_s)
            if len(frames) != 2 or frames[0] != SNAPSHOT_REQUEST:
                raise WireError(f"unexpected reply {frames[:1]!r}")
            snapshot = decode_snapshot(frames[1])
        except (TimeoutError, WireError) as exc:
            self._count("snapshot_failed")
            log.warning("event stream %s: no snapshot: %s", self._control_endpoint, exc or "timed out")
            return False
        finally:
            dealer.close(linger=0)
        self._sink.reset(snapshot)
        self.epoch, self.seq = snapshot.epoch, snapshot.seq
        self._synced_at = time.monotonic()
        self._count("snapshot")
        return True
