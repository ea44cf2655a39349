"""A compromised replica for benchmarks/hostile_fleet.py, run as its own process on loopback:

    python benchmarks/_hostile_replica.py PORT INFO_JSON HUGE_BYTES

HTTP is harness.stub_replica's (``/health`` 200, small completions), plus:

* ``/kvtier/info``: a real replica's info (INFO_JSON, so the router accepts its namespace) naming this process's
  own event endpoints and CURVE key: the router follows it as it would a real replica;
* a prompt containing ``HUGE``: a non-streamed 200 JSON answer of HUGE_BYTES bytes, sent in 1 MiB pieces (R-6);
* ``POST /hostile/flood`` ``{"keys": N, "tiers": T, "snapshot": S, "batch": B}``: publish N stored-chunk events
  in batches of B (default 1,000; real wire format), then T events each naming a tier of its own, and from then on
  answer snapshot requests with S keys, skipping a batch so that the router asks for it (E-3). ``GET /hostile/flood``
  says how many events went out. Until then a snapshot is empty and at the stream's current position, so the
  router follows the batches that come after it (one at a fixed position sent it into a gap-and-resync loop
  that never applied a batch: the full run's index held 0 keys).
* ``POST /admin/v1/lookup`` answering by the body's ``text`` (A-3, the router's admin fan-out) as
  harness.hostile_admin's ``admin_lookup`` does, ``huge`` with HUGE_BYTES (it checks no key).

The event publisher is a process of its own (forked before anything else starts): building and sending
millions of events must not hold this process's GIL, or its HTTP ``/health`` stalls, the router ejects it
and forgets its index, and the flood never reaches the index it is aimed at. Both run at the attackers' nice
(``_hostile_attacks.ATTACKER_NICE``): this process is started niced, and the publisher inherits it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import sys
import time
import uuid
from pathlib import Path

import uvicorn
import zmq
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _hostile_attacks import attacker_priority  # noqa: E402

from kvtier.core.events import TierHolding  # noqa: E402
from kvtier.events.wire import SNAPSHOT_REQUEST, TOPIC, Batch, WireEvent, encode_batch, encode_snapshot  # noqa: E402
from harness.hostile_admin import admin_lookup  # noqa: E402
from harness.stub_replica import create_app  # noqa: E402
from harness.hostile_events import fake_key  # noqa: E402

BATCH = 1000
MIB = 1 << 20


class Publisher(multiprocessing.Process):
    """A CURVE PUB and control ROUTER like a replica's, fed hostile batches on request; heartbeats otherwise.
    ``start()`` returns once the child bound its sockets: ``ports``, ``public_key``, ``epoch`` are set then."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.jobs: multiprocessing.Queue = multiprocessing.Queue()
        self._sent, self._seq = multiprocessing.Value("q", 0), multiprocessing.Value("q", -1)
        self._ready, self._tell = multiprocessing.Pipe(duplex=False)
        self.epoch, self._parent = uuid.uuid4().hex, os.getpid()

    def start(self) -> None:
        super().start()
        self.ports, self.public_key = self._ready.recv()

    @property
    def sent(self) -> int:
        return self._sent.value

    @property
    def seq(self) -> int:
        return self._seq.value

    def _bind(self) -> None:
        self.ctx = zmq.Context()
        public, secret = zmq.curve_keypair()
        self.pub, self.control = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        ports = []
        for socket in (self.pub, self.control):
            socket.setsockopt(zmq.LINGER, 0)
            socket.curve_secretkey, socket.curve_server = secret, True
            ports.append(socket.bind_to_random_port("tcp://127.0.0.1"))
        self.pub.setsockopt(zmq.SNDHWM, 0)  # a flood that waits for nobody: everything goes out
        self.snapshot: bytes | None = None  # until the flood ends: an empty one at the current seq
        self._tell.send((ports, public.decode()))

    def _send(self, events: list[WireEvent]) -> None:
        self._seq.value += 1
        self.pub.send_multipart((TOPIC, self._seq.value.to_bytes(8, "big"),
                                 encode_batch(Batch(self.epoch, self._seq.value, time.time(), events))))
        self._sent.value += len(events)

    def _answer_snapshots(self) -> None:
        while self.control.poll(0):
            client_id, *_ = self.control.recv_multipart()
            snapshot = self.snapshot or encode_snapshot(self.epoch, self.seq, [TierHolding("memory", [])])
            self.control.send_multipart((client_id, SNAPSHOT_REQUEST, snapshot))

    def run(self) -> None:
        attacker_priority()  # inherited from this whole process already (hostile_fleet starts it niced); made sure
        self._bind()
        while os.getppid() == self._parent:  # dies with the replica it belongs to (E-3 kills that one)
            self._answer_snapshots()
            try:
                job = self.jobs.get(timeout=0.2)
            except queue.Empty:
                self._send([])  # a heartbeat
                continue
            batch = job.get("batch", BATCH)
            for start in range(0, job["keys"], batch):
                self._send([WireEvent(True, "memory", bytes(fake_key(i)), 0)
                            for i in range(start, min(start + batch, job["keys"]))])
                if start % (50 * batch) == 0:
                    self._answer_snapshots()
            for i in range(job["tiers"]):
                self._send([WireEvent(True, f"tier-{i}", bytes(fake_key(i)), 0)])
            if job["snapshot"]:
                keys = [fake_key(i) for i in range(job["snapshot"])]
                self.snapshot = encode_snapshot(self.epoch, self.seq + 1, [TierHolding("memory", keys)])
                self._seq.value += 1  # a batch skipped: the router sees a gap and asks for this snapshot


def main() -> None:
    port, info_path, huge = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    publisher = Publisher()
    publisher.start()
    info = json.loads(Path(info_path).read_text())
    info["events"] = {"endpoint": f"tcp://127.0.0.1:{publisher.ports[0]}",
                      "control": f"tcp://127.0.0.1:{publisher.ports[1]}", "epoch": publisher.epoch,
                      "key": publisher.public_key}
    stub = create_app(port)

    async def kvtier_info(request: Request) -> Response:
        return JSONResponse(info)

    async def flood(request: Request) -> Response:
        if request.method == "POST":
            publisher.jobs.put(json.loads(await request.body()))
        return JSONResponse({"sent": publisher.sent, "seq": publisher.seq})

    routes = [Route("/kvtier/info", kvtier_info), Route("/hostile/flood", flood, methods=["GET", "POST"]),
              Route("/admin/v1/lookup", admin_lookup(huge), methods=["POST"])]
    app = Starlette(routes=routes + list(stub.routes))

    async def asgi(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            if b"HUGE" in body:
                return await StreamingResponse(_huge(huge), media_type="application/json")(scope, receive, send)
            sent = False

            async def replay():
                nonlocal sent
                if sent:
                    return {"type": "http.disconnect"}
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}

            return await app(scope, replay, send)
        return await app(scope, receive, send)

    uvicorn.run(asgi, host="127.0.0.1", port=port, log_level="warning")


async def _huge(size: int):
    yield b'{"id": "cmpl-huge", "object": "text_completion", "pad": "'
    piece = b"x" * MIB
    for _ in range(size // MIB):
        yield piece
    yield b'", "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}'


if __name__ == "__main__":
    main()
