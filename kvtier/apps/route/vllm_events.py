"""Follow one vLLM replica's KV events (asyncio): its ZMQ PUB stream in order, replayed where batches were lost.

vLLM publishes batches numbered from 0 per process and keeps the last ``buffer_steps`` of them for its replay
socket (see kvtier.fleet.vllm_wire). vLLM has no snapshot and publishes nothing while idle, so the subscriber:

* on start asks the replay socket for every batch from 0 and applies them, then the live ones after them
  (a live batch the replay already gave is skipped);
* on a gap (a batch beyond the next expected one) asks for the batches from the first missing one;
* on a sequence number going back (the replica restarted: a new process counts from 0 again, which the replay
  buffer of the old one never had) forgets all it knew of the replica and replays from 0;
* when the replay cannot fill what is missing (no replay endpoint, no answer within ``replay_timeout_s``, or the
  buffer no longer reaches back that far) it forgets what it knew and starts over from what it gets: a
  router that believes stale blocks routes worse than one that knows nothing;
* a message that is not ``[topic, seq (8 bytes), batch]`` or whose batch does not decode is dropped and counted
  (``malformed``); single undecodable events inside a batch are counted (``bad_event``) and skipped.

What one message can cost is bounded: at most ``MAX_BATCH_BYTES`` (ZMQ refuses longer ones), a replay at most
``max_replay_batches`` messages. A batch's structure is decoded in one call (about 0.1 s for 100,000 events), then
its events are decoded and applied in slices of about ``keys_per_turn`` router keys (``VllmReplicaIndex.cost``)
per event-loop turn, paced like kvtier's own stream (kvtier.events.subscriber.Pacer), so a flood of big batches
leaves the router's loop free to answer ``/health`` and route between the slices. vLLM's publisher has no authentication (unlike kvtier serve's CURVE sockets):
whoever can reach its ports can publish or replay to the router, so its endpoints must stay on a local or
firewalled network (docs/integrations/vllm-fleet.md).

Counts (``count(what)``): ``batch``, ``replayed``, ``gap``, ``restart``, ``replay_failed``, ``reset``,
``malformed``, ``bad_event``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvtier.events.subscriber import KEYS_PER_TURN, Pacer
from kvtier.fleet.vllm_index import VllmReplicaIndex
from kvtier.fleet.vllm_wire import (
    END_SEQ,
    RawBatch,
    VllmBatch,
    VllmWireError,
    decode_event,
    decode_raw_batch,
    decode_seq,
)

log = logging.getLogger(__name__)

MAX_BATCH_BYTES = 16 << 20
_END = END_SEQ.to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class VllmSubscriberConfig:
    """``replay_timeout_s``: the most time a replay may wait for its messages (time spent applying them does not
    count); ``share`` and ``keys_per_turn``: as kvtier.events.subscriber.SubscriberConfig's."""

    replay_timeout_s: float = 5.0
    max_replay_batches: int = 100_000
    share: float = 0.5
    keys_per_turn: int = KEYS_PER_TURN


class VllmEventSubscriber:
    """``run()`` follows the stream until cancelled, feeding ``sink``."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str | None, topic: str,
                 sink: VllmReplicaIndex, config: VllmSubscriberConfig = VllmSubscriberConfig(),
                 count: Callable[[str], None] = lambda what: None) -> None:
        self._ctx, self._endpoint, self._replay_endpoint = ctx, endpoint, replay_endpoint
        self._topic, self._sink, self._config, self._count = topic.encode(), sink, config, count
        self.next_seq: int | None = None  #: the batch expected next (None: none applied since the last reset)
        # live batches in this range were applied from the last replay: duplicates, not a restart (cleared once
        # the live stream is past it)
        self._replayed = range(0)
        self._replay_works = True  # False after a replay failed: joining mid-stream then asks for none
        self._pacer = Pacer(config.share)
        self._working = 0.0  # this thread's CPU time when this task's current piece of work began

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        sub.connect(self._endpoint)
        sub.subscribe(self._topic)
        try:
            self._reset()
            await self._replay(0)
            while True:
                frames = await sub.recv_multipart()
                self._working = time.thread_time()
                start = await self._receive(frames)
                if start is not None:
                    await self._replay(start)
                # recv returns at once while batches are queued: without a pause a flood starves the loop
                await self._pace()
        finally:
            sub.close(linger=0)

    def _reset(self) -> None:
        self._sink.reset()
        self.next_seq, self._replayed = None, range(0)

    def _parse(self, frames: list[bytes]) -> tuple[int, RawBatch] | None:
        try:
            if len(frames) != 3:
                raise VllmWireError(f"expected 3 frames, got {len(frames)}")
            seq = decode_seq(frames[1])
            if seq < 0:
                raise VllmWireError(f"negative sequence number {seq}")
            return seq, decode_raw_batch(frames[2])
        except VllmWireError as exc:
            self._count("malformed")
            log.warning("vLLM events %s: dropped a message: %s", self._endpoint, exc)
            return None

    async def _apply(self, seq: int, batch: RawBatch) -> None:
        """Decode and apply ``batch``'s events in order, ``keys_per_turn`` router keys a slice, the loop served
        (paced) between slices: 100,000 events decoded and applied in one turn held the loop for seconds on a
        loaded machine. Nothing else feeds this sink, so a batch applied in slices is the batch applied whole; one
        the index chokes on (a bug) is skipped from there, counted, and the stream followed on."""
        budget, piece, keys = max(self._config.keys_per_turn, 1), [], 0
        for item in batch.events:
            event = decode_event(item)
            if event is None:
                self._count("bad_event")
                continue
            piece.append(event)
            keys += self._sink.cost(event)
            if keys >= budget:
                if not self._apply_piece(seq, batch.ts, piece):
                    break
                piece, keys = [], 0
                await self._pace()
        else:
            self._apply_piece(seq, batch.ts, piece)
        self.next_seq = seq + 1
        await self._pace()

    async def _pace(self) -> None:
        await self._pacer.spent(time.thread_time() - self._working)
        self._working = time.thread_time()

    def _apply_piece(self, seq: int, ts: float, events: list) -> bool:
        if not events:
            return True
        try:
            self._sink.apply(VllmBatch(ts, events))
        except Exception:  # the index choked on one batch (a bug): skip it, counted, and keep following
            log.exception("vLLM events %s: applying batch %d failed; skipped", self._endpoint, seq)
            self._count("apply_failed")
            return False
        return True

    async def _receive(self, frames: list[bytes]) -> int | None:
        """Apply a live message; the sequence number to replay from when batches are missing, else None."""
        parsed = self._parse(frames)
        if parsed is None:
            return None
        seq, batch = parsed
        expected = self.next_seq
        if expected is None or seq == expected:
            self._replayed = range(0)
            if expected is None and seq != 0:  # joined mid-stream: what came before is unknown
                if self._replay_endpoint is not None and self._replay_works:
                    self._count("gap")
                    return 0
            await self._apply(seq, batch)
            self._count("batch")
            return None
        if seq < expected:
            if seq in self._replayed:
                return None  # already applied from the replay
            self._count("restart")
            log.warning("vLLM events %s: sequence went back from %d to %d: the replica restarted", self._endpoint,
                        expected, seq)
            self._reset()
            if self._replay_endpoint is None:
                await self._apply(seq, batch)
                return None
            return 0
        self._count("gap")
        if self._replay_endpoint is None:
            self._count("reset")
            self._reset()
            await self._apply(seq, batch)
            return None
        return expected

    async def _replay(self, start: int) -> None:
        """Ask for the batches from ``start`` and apply them in order; reset when they cannot fill the gap."""
        if self._replay_endpoint is None:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        dealer.connect(self._replay_endpoint)
        deadline = time.monotonic() + self._config.replay_timeout_s
        filled = False
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(self._config.max_replay_batches):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                frames = await asyncio.wait_for(dealer.recv_multipart(), left)
                self._working = time.thread_time()
                if len(frames) == 4 and frames[1] == b"" and frames[2] == _END:
                    filled = True
                    break
                parsed = self._parse(frames[1:] if frames[:1] == [b""] else frames)
                if parsed is None:
                    continue
                seq, batch = parsed
                expected = start if self.next_seq is None else self.next_seq
                if seq < expected:
                    continue
                if seq > expected:  # the buffer no longer reaches back to what is missing
                    self._count("reset")
                    self._reset()
                applying = time.monotonic()
                await self._apply(seq, batch)
                deadline += time.monotonic() - applying  # the timeout is for the replayer, not for this side
                self._replayed = range(min(start, seq), seq + 1)
                self._count("replayed")
        except TimeoutError:
            self._count("replay_failed")
            log.warning("vLLM events %s: replay from %d did not finish within %.0f s", self._replay_endpoint, start,
                        self._config.replay_timeout_s)
        finally:
            dealer.close(linger=0)
        self._replay_works = filled
        if not filled and self.next_seq is not None and start > 0 and self.next_seq <= start:
            self._count("reset")  # nothing filled the gap: what was known may be stale
            self._reset()
