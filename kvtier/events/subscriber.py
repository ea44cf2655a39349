"""Follow one replica's event stream (asyncio): snapshot first, then batches in order, snapshot again on a gap.

The subscriber keeps a ``ReplicaHoldings`` (what the replica holds, per tier) in step with the replica:

* at start, after a restart of the replica (a new epoch) and after a lost batch (a gap in ``seq``), it asks
  the replica's control socket for a snapshot and replaces what it knew; batches the snapshot already
  reflects (``seq`` <= the snapshot's) are skipped, later ones applied in order;
* every ``resync_s`` it takes a snapshot anyway, which bounds the damage of the rare reordering a stream can
  have (see kvtier.core.events);
* a message that does not decode is counted and dropped (then the next batch shows a gap).

Only the replica itself can feed the sink: both sockets are CURVE clients of the replica's public key (from its
``/kvtier/info``, fetched from the URL the router was configured with), so a process that takes the replica's
event ports after it died fails the handshake and is never heard. The client key is the router's own key pair
(kvtier.events.keys), which the replica must allow: one it does not is refused at the handshake, and the
subscriber goes on asking for a snapshot every ``retry_s`` (the replica logs the key it refused). What one
message can cost is bounded: a batch at most ``MAX_BATCH_BYTES``, a snapshot at most ``MAX_SNAPSHOT_BYTES``
(ZMQ refuses longer ones), and a snapshot is decoded and prepared (``HoldingsSink.prepare``) in a worker
thread, off the event loop: its structure in one call, its keys in pieces of ``wire.KEYS_PIECE`` (one call each,
so the loop gets the GIL between them). A batch's structure is read in one call (its events as raw spans: about
a quarter of a full decode, ~75 ms for the largest batch allowed) and its events are decoded and applied
``KEYS_PER_TURN`` per loop turn, paced (``Pacer``), so a flood of big batches leaves the loop free to answer
``/health`` and route between the slices.

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

from kvtier.events.keys import default_key_file, load_or_create
from kvtier.events.wire import (
    SNAPSHOT_REQUEST,
    TOPIC,
    Batch,
    BatchHead,
    SnapshotHead,
    WireError,
    decode_batch_head,
    decode_events,
    decode_snapshot_head,
)

log = logging.getLogger(__name__)

MAX_BATCH_BYTES = 16 << 20  #: ~300k events; a publisher's batch holds at most its max_queue (100k by default)
MAX_SNAPSHOT_BYTES = 96 << 20  #: ~2.8M keys; a publisher sends at most its max_snapshot_keys (2M by default)
KEYS_PER_TURN = 2_048  #: events of one batch applied per event-loop turn (a few ms of the loop's time)


class HoldingsSink(Protocol):
    """What a subscriber keeps up to date (the router's index of one replica)."""

    def prepare(self, snapshot: SnapshotHead) -> object:
        """The work of adopting ``snapshot`` that touches nothing shared (runs in a worker thread); its keys are
        raw, for ``wire.snapshot_keys`` to decode in pieces (which raises WireError if they are malformed)."""

    def reset(self, prepared: object) -> None:
        """Adopt what ``prepare`` returned (on the event loop)."""

    def apply(self, batch: Batch) -> None: ...


@dataclass(frozen=True)
class SubscriberConfig:
    """``share``: the most of the event loop's time that applying batches may take while they are queued
    (``Pacer``); ``keys_per_turn``: the most events of one batch applied in one event-loop turn."""

    snapshot_timeout_s: float = 5.0
    resync_s: float = 300.0
    retry_s: float = 1.0
    share: float = 0.5
    keys_per_turn: int = KEYS_PER_TURN


class Pacer:
    """Keeps work done in slices to at most ``share`` of the time: after each ``slice_s`` of CPU spent (told by
    ``spent``), the caller sleeps long enough for that share, and otherwise yields one loop turn.

    A flood of batches queued at a subscriber would otherwise keep the router's loop busy until it is drained:
    every batch is a bounded piece, but a process that is always runnable is the one a busy machine's scheduler
    leaves waiting, and ``/health`` waits with it. Paced, the process sleeps between slices. A replica's normal
    stream is far below the share and is never slowed; a flood takes longer to apply."""

    def __init__(self, share: float = 0.5, slice_s: float = 0.005, sleep=asyncio.sleep) -> None:
        self.share, self.slice_s, self._sleep = min(max(share, 0.01), 1.0), slice_s, sleep
        self._busy = 0.0

    async def spent(self, seconds: float) -> None:
        self._busy += max(seconds, 0.0)
        if self._busy < self.slice_s or self.share >= 1.0:
            await self._sleep(0)
            return
        pause, self._busy = self._busy * (1 - self.share) / self.share, 0.0
        await self._sleep(pause)


class EventSubscriber:
    """``run()`` follows the stream until cancelled; ``count(what)`` is told of snapshots, batches, errors."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, control_endpoint: str, server_key: bytes,
                 sink: HoldingsSink, config: SubscriberConfig = SubscriberConfig(),
                 count: Callable[[str], None] = lambda what: None,
                 client_key: tuple[bytes, bytes] | None = None) -> None:
        """``server_key``: the replica's CURVE public key (Z85), as its ``/kvtier/info`` gives it;
        ``client_key``: this side's (public, secret) pair, Z85 (None: this user's default router key pair)."""
        self._ctx, self._endpoint, self._control_endpoint = ctx, endpoint, control_endpoint
        self._server_key = server_key
        self._client_key = client_key if client_key is not None else load_or_create(default_key_file())
        self._sink, self._config, self._count = sink, config, count
        self._pacer = Pacer(config.share)
        self.epoch: str | None = None
        self.seq = -1
        self._synced_at = 0.0

    def _socket(self, kind: int, max_bytes: int) -> zmq.asyncio.Socket:
        socket = self._ctx.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        socket.curve_publickey, socket.curve_secretkey = self._client_key
        socket.curve_serverkey = self._server_key
        return socket

    async def run(self) -> None:
        sub = self._socket(zmq.SUB, MAX_BATCH_BYTES)
        sub.connect(self._endpoint)
        sub.subscribe(TOPIC)
        try:
            while self.epoch is None:
                if not await self._resync():
                    await asyncio.sleep(self._config.retry_s)
            while True:
                frames = await sub.recv_multipart(copy=False)  # a 16 MB batch is not copied on the loop
                spent = time.thread_time()
                batch = self._receive(frames)
                # pyzmq's recv returns a finished future while batches are queued, so without a pause a flood
                # (4 M stores) is applied without the loop ever running anything else
                if batch is None:
                    await self._pacer.spent(time.thread_time() - spent)
                else:
                    await self._apply(batch, time.thread_time() - spent)
                if self.epoch is None or time.monotonic() - self._synced_at > self._config.resync_s:
                    await self._resync()
        finally:
            sub.close(linger=0)

    async def _apply(self, head: BatchHead, spent: float) -> None:
        """Decode and apply ``head``'s events ``keys_per_turn`` at a time, the loop served between (paced): a
        batch of 100,000 events applied in one turn held the loop a third of a second on an idle machine, and
        decoding one of 330,000 in one call ~270 ms on a loaded one, while ``/health`` waited. Batches are
        applied whole and in order all the same: nothing else feeds this sink, and ``seq`` moves on only once all
        of the batch is in. A slice that is not valid events ends the batch there and resynchronises."""
        raw, step = head.events, max(self._config.keys_per_turn, 1)
        for start in range(0, max(len(raw), 1), step):
            began = time.thread_time()
            try:
                events = decode_events(raw[start: start + step])
            except WireError as exc:
                self._count("malformed")
                log.warning("event stream %s: batch %d: %s; resynchronising", self._endpoint, head.seq, exc)
                self.epoch = None
                return
            try:
                self._sink.apply(Batch(head.epoch, head.seq, head.ts, events))
            except Exception:  # the sink choked on one batch (a bug): resynchronise from a snapshot, go on listening
                log.exception("event stream %s: applying batch %d failed; resynchronising", self._endpoint,
                              head.seq)
                self._count("apply_failed")
                self.epoch = None
                return
            await self._pacer.spent(spent + time.thread_time() - began)
            spent = 0.0
        self.seq = head.seq
        self._count("batch")

    def _receive(self, frames: list[zmq.Frame] | list[bytes]) -> BatchHead | None:
        """The batch in ``frames`` (its events not yet decoded) if it is the next one to apply; None for a
        message dropped, a batch already applied, or one after a gap (then ``epoch`` is None: the caller
        resynchronises)."""
        try:
            if len(frames) != 3:
                raise WireError(f"expected 3 frames, got {len(frames)}")
            batch = decode_batch_head(getattr(frames[2], "buffer", frames[2]))  # a zmq.Frame, or bytes
        except WireError as exc:
            self._count("malformed")
            log.warning("event stream %s: dropped a message: %s", self._endpoint, exc)
            return None
        if batch.epoch == self.epoch and batch.seq <= self.seq:
            return None  # already in the snapshot
        if batch.epoch != self.epoch or batch.seq != self.seq + 1:
            self._count("gap" if batch.epoch == self.epoch else "new_epoch")
            self.epoch = None  # the caller resynchronises; this batch is in the snapshot it gets
            return None
        return batch

    async def _resync(self) -> bool:
        """Ask for a snapshot and adopt it; False if the replica did not answer in time."""
        dealer = self._socket(zmq.DEALER, MAX_SNAPSHOT_BYTES)
        dealer.connect(self._control_endpoint)
        try:
            await dealer.send_multipart([SNAPSHOT_REQUEST])
            # zero-copy: a snapshot of 2.5M keys is an 85 MB frame, and copying it into bytes held the loop
            # ~80 ms (fresh pages fault in at ~1 GB/s here); its buffer is decoded on the worker thread instead
            frames = await asyncio.wait_for(dealer.recv_multipart(copy=False), self._config.snapshot_timeout_s)
            if len(frames) != 2 or frames[0].bytes != SNAPSHOT_REQUEST:
                raise WireError(f"unexpected reply {frames[0].bytes[:16]!r}")
            snapshot, prepared = await asyncio.to_thread(self._prepare, frames[1].buffer)
        except (TimeoutError, WireError) as exc:
            self._count("snapshot_failed")
            log.warning("event stream %s: no snapshot: %s", self._control_endpoint, exc or "timed out")
            return False
        except Exception:  # the sink choked on this snapshot (a bug): count it, and the caller asks again later
            self._count("snapshot_failed")
            log.exception("event stream %s: preparing a snapshot failed", self._control_endpoint)
            return False
        finally:
            dealer.close(linger=0)
        self._sink.reset(prepared)
        self.epoch, self.seq = snapshot.epoch, snapshot.seq
        self._synced_at = time.monotonic()
        self._count("snapshot")
        return True

    def _prepare(self, payload: bytes | memoryview) -> tuple[SnapshotHead, object]:
        snapshot = decode_snapshot_head(payload)
        return snapshot, self._sink.prepare(snapshot)
