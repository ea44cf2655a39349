"""A stand-in for vLLM's KV-event publisher, as a process: a real ZMQ PUB socket and replay ROUTER socket speaking
vLLM's wire format (``[topic, seq, msgpack [ts, events, dp_rank]]``; replay ``[b"", start]`` answered with the
buffered batches and the ``-1`` end marker), driven by JSON lines on stdin:

* ``{"op": "batch", "events": [...], "publish": true}``: the next batch (events as vLLM's maps, ``type`` tags);
  with ``publish`` false it is only buffered for replay (a batch the subscriber lost);
* ``{"op": "raw", "frames": ["hex", ...]}``: any multipart message (malformed ones);
* ``{"op": "flood", "n": N, "block_size": B}``: the next batch is N stores of one root block each, block hash
  ``10**6 + i`` and tokens ``[i, 0, 0, ...]`` (B of them): a compromised or very busy replica's big batch;
* ``{"op": "restart"}``: sequence numbers and the replay buffer start over (a new vLLM process);
* ``{"op": "replay_off"}``: replay requests are read and never answered.

Prints ``ready PUB_PORT REPLAY_PORT`` once bound, then ``ok N`` after each command (N: replay requests so far).
"""

from __future__ import annotations

import json
import sys
import time

import msgspec
import zmq

TOPIC = b"kv@test@model"


def main() -> None:
    ctx = zmq.Context()
    pub, replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
    buffer: list[tuple[int, bytes]] = []
    seq, requests, answer = 0, 0, True
    print(f"ready {pub_port} {replay_port}", flush=True)
    poller = zmq.Poller()
    poller.register(replay, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            if sock is replay:
                client, _, start = replay.recv_multipart()
                requests += 1
                if not answer:
                    continue
                first = int.from_bytes(start, "big")
                for n, payload in buffer:
                    if n >= first:
                        replay.send_multipart((client, b"", TOPIC, n.to_bytes(8, "big"), payload))
                replay.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))
                continue
            line = sys.stdin.readline()
            if not line:
                return
            command = json.loads(line)
            op = command["op"]
            if op == "flood":
                size = command["block_size"]
                command["events"] = [{"type": "BlockStored", "block_hashes": [10**6 + i], "parent_block_hash": None,
                                      "token_ids": [i] + [0] * (size - 1), "block_size": size, "medium": "GPU"}
                                     for i in range(command["n"])]
                op = "batch"
            if op == "batch":
                payload = msgspec.msgpack.encode([time.time(), command["events"], None])
                buffer.append((seq, payload))
                if command.get("publish", True):
                    pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), payload))
                seq += 1
            elif op == "raw":
                pub.send_multipart([bytes.fromhex(frame) for frame in command["frames"]])
            elif op == "restart":
                seq, buffer = 0, []
            elif op == "replay_off":
                answer = False
            print(f"ok {requests}", flush=True)


if __name__ == "__main__":
    main()
