"""Hostile peers of the event channel, each run as its own process (``python -m harness.hostile_events WHAT ...``).

They speak the real wire format (kvtier.events.wire) over real ZMQ sockets, and every loop is bounded in count
and time. Each prints ``READY`` once its sockets are set up, and exits by itself.

* ``subscribe ENDPOINT KEY N [KEYFILE]``: opens N distinct subscriptions on a replica's event socket and stays
  connected.
* ``snapshots ENDPOINT KEY N [KEYFILE]``: asks a replica's control socket for N snapshots and never reads a reply.

Both bring a CURVE key pair of their own (a local process the replica does not know), or, with KEYFILE, the
router's (kvtier.events.keys: a peer the replica lets in, such as a compromised router).
* ``impostor PORT CONTROL_PORT N``: binds a (dead) replica's event ports with a CURVE key pair of its own and
  serves N fake keys: a batch of stores per heartbeat and a snapshot to whoever asks.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import zmq

from kvtier.base.keys import ChunkHash
from kvtier.core.events import TierHolding
from kvtier.events.keys import load_or_create
from kvtier.events.wire import SNAPSHOT_REQUEST, TOPIC, Batch, WireEvent, encode_batch, encode_snapshot

LIFETIME_S = 20.0


def fake_key(i: int) -> ChunkHash:
    return ChunkHash(hashlib.sha256(b"fake-%d" % i).digest())


def client(ctx: zmq.Context, kind: int, endpoint: str, server_key: str, hwm: int = 1000,
           key_file: str | None = None) -> zmq.Socket:
    socket = ctx.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.curve_publickey, socket.curve_secretkey = load_or_create(Path(key_file)) if key_file else \
        zmq.curve_keypair()
    socket.curve_serverkey = server_key.encode()
    socket.connect(endpoint)
    return socket


def subscribe(endpoint: str, server_key: str, n: int, key_file: str | None = None) -> None:
    ctx = zmq.Context()
    sub = client(ctx, zmq.SUB, endpoint, server_key, hwm=0, key_file=key_file)  # no limit: every subscription goes out
    for i in range(n):
        sub.subscribe(b"x%d" % i)
    print("READY", flush=True)
    time.sleep(LIFETIME_S)


def snapshots(endpoint: str, server_key: str, n: int, key_file: str | None = None) -> None:
    ctx = zmq.Context()
    dealer = client(ctx, zmq.DEALER, endpoint, server_key, key_file=key_file)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    for _ in range(n):
        dealer.send(SNAPSHOT_REQUEST)
    print("READY", flush=True)
    time.sleep(LIFETIME_S)


def impostor(port: int, control_port: int, n: int) -> None:
    ctx = zmq.Context()
    _, secret = zmq.curve_keypair()
    pub, control = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for socket, at in ((pub, port), (control, control_port)):
        socket.setsockopt(zmq.LINGER, 0)
        socket.curve_secretkey, socket.curve_server = secret, True
        socket.bind(f"tcp://127.0.0.1:{at}")
    keys = [fake_key(i) for i in range(n)]
    snapshot = encode_snapshot("impostor", 0, [TierHolding("memory", keys)])
    print("READY", flush=True)
    deadline, seq = time.monotonic() + LIFETIME_S, 0
    while time.monotonic() < deadline:
        if control.poll(50):
            client_id, *_ = control.recv_multipart()
            control.send_multipart((client_id, SNAPSHOT_REQUEST, snapshot))
        seq += 1
        events = [WireEvent(True, "memory", bytes(k), 0) for k in keys[:1000]]
        pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), encode_batch(Batch("impostor", seq, 0.0, events))))


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    if what == "impostor":
        impostor(int(args[0]), int(args[1]), int(args[2]))
    else:
        {"subscribe": subscribe, "snapshots": snapshots}[what](args[0], args[1], int(args[2]), *args[3:4])
