"""A compromised kvtier replica that floods its event stream, run as its own process on loopback:

    python -m tests.apps.route.flood_replica PORT BATCHES EVENTS_PER_BATCH

Real HTTP (uvicorn): ``/health`` 200 and a ``/kvtier/info`` naming a cache and this process's own event
endpoints and CURVE key, so ``kvtier route`` follows its stream as a real replica's. Real ZMQ: a CURVE PUB and
control ROUTER speaking kvtier's wire format. ``POST /flood`` publishes BATCHES batches of EVENTS_PER_BATCH
distinct stored-chunk events each in the ``memory`` tier, as fast as the socket takes them; ``GET /flood``
says how many went out. A snapshot request is answered with every key sent so far at the stream's position,
so a subscriber that resynchronises still ends up with all of them. Prints ``READY`` when it serves.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import uvicorn
import zmq
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvtier.core.events import TierHolding
from kvtier.events.wire import SNAPSHOT_REQUEST, TOPIC, Batch, WireEvent, encode_batch, encode_snapshot

NAMESPACE = {"model": "flood@0", "layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "float32", "chunk_size": 16}


class Flood:
    """The publisher: sockets bound at construction; ``start`` floods from a thread, ``serve`` answers snapshots."""

    def __init__(self, batches: int, per_batch: int) -> None:
        self.ctx = zmq.Context()
        public, secret = zmq.curve_keypair()
        self.public_key = public.decode()
        self.pub, self.control = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.ports = []
        for socket in (self.pub, self.control):
            socket.setsockopt(zmq.LINGER, 0)
            socket.curve_secretkey, socket.curve_server = secret, True
            self.ports.append(socket.bind_to_random_port("tcp://127.0.0.1"))
        self.pub.setsockopt(zmq.SNDHWM, 0)  # nothing dropped: every batch reaches the router
        self.epoch, self.seq, self.sent = uuid.uuid4().hex, 0, 0
        keys = os.urandom(32 * batches * per_batch)  # distinct (with overwhelming probability), made at once
        self.keys = [keys[i: i + 32] for i in range(0, len(keys), 32)]
        self.batches, self.per_batch = batches, per_batch
        self.lock = threading.Lock()  # seq, sent: the flood thread writes, the snapshot thread reads
        self.started = False

    def start(self) -> None:
        self.started = True
        threading.Thread(target=self._flood, daemon=True).start()

    def _flood(self) -> None:
        for b in range(self.batches):
            keys = self.keys[b * self.per_batch: (b + 1) * self.per_batch]
            payload = encode_batch(Batch(self.epoch, self.seq + 1, time.time(),
                                         [WireEvent(True, "memory", k, 0) for k in keys]))
            with self.lock:
                self.seq += 1
                self.pub.send_multipart((TOPIC, self.seq.to_bytes(8, "big"), payload))
                self.sent += len(keys)

    def serve_snapshots(self) -> None:
        while True:
            if not self.control.poll(200):
                continue
            client, *_ = self.control.recv_multipart()
            with self.lock:
                seq, keys = self.seq, self.keys[: self.sent]
            self.control.send_multipart((client, SNAPSHOT_REQUEST,
                                         encode_snapshot(self.epoch, seq, [TierHolding("memory", keys)])))


def create_app(flood: Flood) -> Starlette:
    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def info(request: Request) -> JSONResponse:
        events = {"endpoint": f"tcp://127.0.0.1:{flood.ports[0]}", "control": f"tcp://127.0.0.1:{flood.ports[1]}",
                  "epoch": flood.epoch, "key": flood.public_key}
        return JSONResponse({"kvtier": 1, "model": "flood", "cache": True, "namespace": NAMESPACE,
                             "tiers": [{"name": "memory", "store_id": None}], "events": events})

    async def start(request: Request) -> JSONResponse:
        if not flood.started:
            flood.start()
        return JSONResponse({"started": True})

    async def progress(request: Request) -> JSONResponse:
        return JSONResponse({"sent": flood.sent, "total": flood.batches * flood.per_batch})

    return Starlette(routes=[Route("/health", health), Route("/kvtier/info", info),
                             Route("/flood", start, methods=["POST"]), Route("/flood", progress)])


if __name__ == "__main__":
    port, batches, per_batch = (int(a) for a in sys.argv[1:4])
    flood = Flood(batches, per_batch)
    threading.Thread(target=flood.serve_snapshots, daemon=True).start()
    print("READY", flush=True)
    uvicorn.run(create_app(flood), host="127.0.0.1", port=port, log_level="warning")
