"""The router's follower of vLLM's KV events against a real ZMQ publisher process speaking vLLM's wire format
(tests/apps/route/vllm_publisher.py): stores become the router's keys of the blocks' tokens per medium, lost
batches are replayed, a restart starts over, malformed messages and events are counted drops.

The wire format itself is checked against vLLM's own classes in tests/integrations/test_vllm_fleet_events.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio

from kvtier.apps.route.vllm_events import VllmEventSubscriber, VllmSubscriberConfig
from kvtier.fleet.index import FleetIndex
from kvtier.fleet.vllm_index import VllmReplicaIndex, vllm_namespace

BLOCK = 4
MEDIA = ("GPU", "CPU", "STORAGE")
SCRIPT = Path(__file__).with_name("vllm_publisher.py")


class Publisher:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        _, pub, replay = self.proc.stdout.readline().split()
        self.endpoint, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        self.replay_requests = 0

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        self.replay_requests = int(self.proc.stdout.readline().split()[1])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def stored(hashes, parent, tokens, medium="GPU", size=BLOCK) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "lora_id": None, "medium": medium, "lora_name": None}


def removed(hashes, medium="GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


class Follower:
    """A FleetIndex fed by a VllmEventSubscriber on its own event loop thread-free: driven by ``until``."""

    def __init__(self, publisher: Publisher, replay: bool = True) -> None:
        self.index = FleetIndex(max_total_keys=1000, replicas=1)
        self.counts: dict[str, int] = {}
        self.sink = VllmReplicaIndex(self.index.holdings("r"), BLOCK, MEDIA, count=self._count)
        self.ctx = zmq.asyncio.Context()
        self.subscriber = VllmEventSubscriber(self.ctx, publisher.endpoint, publisher.replay if replay else None,
                                              "kv@", self.sink, VllmSubscriberConfig(replay_timeout_s=1.0),
                                              self._count)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def cached(self, tokens: list[int]) -> dict[str, int]:
        return self.index.cached("r", vllm_namespace(BLOCK).chunk_hashes(tokens))


async def until(check, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not check():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def publisher():
    pub = Publisher()
    yield pub
    pub.close()


def run(follower: Follower, scenario) -> None:
    async def main():
        task = asyncio.ensure_future(follower.subscriber.run())
        try:
            await asyncio.sleep(0.3)  # the SUB socket connects (ZMQ's slow joiner)
            await scenario()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            follower.ctx.destroy(linger=0)

    asyncio.run(main())


def test_stores_are_indexed_per_medium_from_token_ids_and_removals_undo_them(publisher):
    follower = Follower(publisher)
    prompt = list(range(100, 112))  # 3 blocks

    async def scenario():
        publisher.send(op="batch", events=[stored([11, 12], None, prompt[:8]), stored([13], 12, prompt[8:12])])
        await until(lambda: follower.cached(prompt) == {"GPU": 3}, "three GPU blocks")
        # a kvtier chunk of 2 blocks (block_size 8) in the CPU medium, by its own hash, then moved without tokens
        publisher.send(op="batch", events=[stored([7777], None, prompt[:8], "CPU", 8),
                                           removed([12]), stored([7777], None, [], "STORAGE", 8)])
        await until(lambda: follower.cached(prompt) == {"GPU": 2, "CPU": 1}, "GPU, CPU, GPU")
        assert follower.index.chunks("r") == {"GPU": 2, "CPU": 2, "STORAGE": 2}
        publisher.send(op="batch", events=[{"type": "AllBlocksCleared"}])
        await until(lambda: follower.cached(prompt) == {"CPU": 2}, "the device cache cleared")
        # an orphan (unknown parent), a LoRA block and a medium the replica was not configured with
        publisher.send(op="batch", events=[stored([21], 999, prompt[:4]), {**stored([22], None, prompt[:4]),
                                           "lora_name": "a"}, stored([23], None, [7, 7, 7, 7], "NVME")])
        await until(lambda: follower.counts.get("batch", 0) >= 4, "the fourth batch")

    run(follower, scenario)
    assert follower.counts["orphan"] == 1 and follower.counts["unindexed"] == 1
    assert follower.index.dropped("r") == 1  # the NVME store
    assert follower.cached([7, 7, 7, 7]) == {}


def test_blocks_of_images_embeddings_or_a_salt_and_their_descendants_are_never_indexed(publisher):
    """vLLM's per-block extra keys, in its event shape (``to_event_extra_keys``): an image's blocks, a prompt of
    embeddings (placeholder token ids) and a salted block are not indexed, nor any block chained after them, so a
    text prompt of the same token ids is never scored against them; the text before the image is."""
    follower = Follower(publisher)
    text = list(range(300, 320))
    placeholders = [9] * 8  # an image's placeholder ids: the same for every image of its size

    async def scenario():
        publisher.send(op="batch", events=[
            stored([31, 32], None, text[:8]),
            {**stored([33, 34], 32, placeholders), "extra_keys": [[["mm-a", 0]], [["mm-a", 4]]]},
            stored([35], 34, text[16:20]),
            {**stored([41, 42], None, [0] * 8), "extra_keys": [["digest-1"], ["digest-2"]]},
            {**stored([51, 52], None, text[:8], "CPU"), "extra_keys": [["salt"], None]},
        ])
        await until(lambda: follower.counts.get("orphan", 0) >= 1, "the batch")

    run(follower, scenario)
    assert follower.cached(text[:8] + placeholders + text[16:20]) == {"GPU": 2}
    assert follower.cached([0] * 8) == {} and follower.cached(text[:8]) == {"GPU": 2}
    assert follower.counts["unindexed"] == 3 and follower.counts["orphan"] == 1


def test_malformed_messages_and_events_are_counted_drops(publisher):
    follower = Follower(publisher)
    prompt = list(range(4))

    async def scenario():
        seq0 = (0).to_bytes(8, "big").hex()
        publisher.send(op="raw", frames=["6b76406a756e6b"])  # one frame
        publisher.send(op="raw", frames=["6b7640", "0001", b"x".hex()])  # a short seq
        publisher.send(op="raw", frames=["6b7640", seq0, b"\xc1not msgpack".hex()])
        publisher.send(op="raw", frames=["6b7640", seq0, msgspec.msgpack.encode({"ts": 1}).hex()])
        publisher.send(op="batch", events=[{"type": "Evil", "x": 1}, {"type": "BlockStored", "block_hashes": "no"},
                                           stored([1], None, prompt)])
        await until(lambda: follower.cached(prompt) == {"GPU": 1}, "the good event of the batch")

    run(follower, scenario)
    assert follower.counts["malformed"] == 4 and follower.counts["bad_event"] == 2


def test_a_lost_batch_is_replayed_and_a_restart_starts_over(publisher):
    follower = Follower(publisher)
    a, b = list(range(10, 14)), list(range(20, 24))

    async def scenario():
        publisher.send(op="batch", events=[stored([1], None, a)])
        await until(lambda: follower.cached(a) == {"GPU": 1}, "the first batch")
        before = publisher.replay_requests
        publisher.send(op="batch", events=[stored([2], None, b)], publish=False)  # lost on the way
        publisher.send(op="batch", events=[removed([1])])
        await until(lambda: follower.cached(a) == {} and follower.cached(b) == {"GPU": 1}, "the replayed batch")
        publisher.send(op="noop")
        assert publisher.replay_requests > before and follower.counts["gap"] >= 1
        assert follower.subscriber.next_seq == 3
        publisher.send(op="restart")  # a new process: seq 0 again, nothing of the old one holds
        publisher.send(op="batch", events=[stored([5], None, a)])
        await until(lambda: follower.counts.get("restart", 0) == 1 and follower.cached(a) == {"GPU": 1},
                    "the restart")
        assert follower.cached(b) == {}

    run(follower, scenario)


def test_without_replay_a_gap_resets_what_was_known(publisher):
    follower = Follower(publisher, replay=False)
    a, b = list(range(10, 14)), list(range(20, 24))

    async def scenario():
        publisher.send(op="batch", events=[stored([1], None, a)])
        await until(lambda: follower.cached(a) == {"GPU": 1}, "the first batch")
        publisher.send(op="batch", events=[removed([1])], publish=False)
        publisher.send(op="batch", events=[stored([2], None, b)])
        await until(lambda: follower.cached(b) == {"GPU": 1}, "the batch after the gap")
        assert follower.cached(a) == {}  # its removal was lost: forgotten rather than believed

    run(follower, scenario)
    assert follower.counts["reset"] == 1


def test_the_index_of_a_replica_is_bounded_oldest_blocks_forgotten(publisher):
    follower = Follower(publisher)
    follower.sink.max_keys = 10

    async def scenario():
        for i in range(30):
            publisher.send(op="batch", events=[stored([1000 + i], None, [i] * BLOCK)])
        await until(lambda: follower.counts.get("batch", 0) == 30, "every batch")

    run(follower, scenario)
    assert follower.sink.blocks() == 10 and follower.index.chunks("r")["GPU"] == 10
    assert follower.cached([29] * BLOCK) == {"GPU": 1} and follower.cached([0] * BLOCK) == {}


def test_a_shared_medium_counts_for_every_replica_naming_the_same_store():
    from kvtier.fleet.vllm_wire import BlockStored, VllmBatch

    index = FleetIndex(replicas=2)
    sinks = [VllmReplicaIndex(index.holdings(name), BLOCK, MEDIA + ("SHARED",), shared={"SHARED": "valkey-1"})
             for name in ("r1", "r2")]
    for sink in sinks:
        sink.reset()
    prompt = list(range(8))
    sinks[0].apply(VllmBatch(0.0, [BlockStored([b"k" * 32], None, prompt, 2 * BLOCK, medium="SHARED")]))
    keys = vllm_namespace(BLOCK).chunk_hashes(prompt)
    assert index.cached("r1", keys) == index.cached("r2", keys) == {"SHARED": 2}


def test_replica_entries_parse_from_the_command_line():
    from kvtier.apps.route.config import ConfigError, ReplicaEntry, RouterConfig, VllmEvents, parse_replica

    entry = parse_replica("http://h:8000/,events=tcp://h:5557,replay=tcp://h:5558,block-size=32,topic=kv@,"
                          "media=GPU:CPU,shared=v1")
    assert entry == ReplicaEntry("http://h:8000", VllmEvents("tcp://h:5557", "tcp://h:5558", "kv@", 32, ("GPU", "CPU"),
                                                             "v1"))
    assert parse_replica("http://h:8000") == ReplicaEntry("http://h:8000")
    assert RouterConfig(("http://a:1", entry)).replicas == (ReplicaEntry("http://a:1"), entry)
    for bad in ("http://h:8000,replay=tcp://h:1", "http://h:8000,events=tcp://*:5557", "http://h,events=udp://h:1",
                "http://h,events=tcp://h:1,block-size=x", "http://h,events=tcp://h:1,colour=red"):
        with pytest.raises(ConfigError):
            parse_replica(bad)


def test_a_replica_entry_follows_its_events_and_a_restart_drops_the_routers_own_record(publisher):
    """The router's own path: a ``Replica`` whose entry names vLLM events feeds the fleet index under its name;
    the publisher restarting also drops what the router recorded having sent it."""
    from kvtier.apps.route.config import ProxyConfig, ReplicaEntry, VllmEvents
    from kvtier.apps.route.replicas import Replica
    from kvtier.events.subscriber import SubscriberConfig
    from kvtier.fleet.index import RECENT

    prompt = list(range(40, 48))
    index = FleetIndex(replicas=1)
    counts: dict[str, int] = {}

    def count(what: str) -> None:
        counts[what] = counts.get(what, 0) + 1

    async def main():
        replica = Replica(ReplicaEntry("http://127.0.0.1:9", VllmEvents(publisher.endpoint, publisher.replay, "kv@",
                                                                        BLOCK, MEDIA)), ProxyConfig())
        keys = replica.namespace(vllm_namespace(99)).chunk_hashes(prompt)
        ctx = zmq.asyncio.Context()
        try:
            replica.follow_events(ctx, index, SubscriberConfig(), count)
            await asyncio.sleep(0.3)
            publisher.send(op="batch", events=[stored([1, 2], None, prompt)])
            await until(lambda: index.cached(replica.name, keys) == {"GPU": 2}, "the replica's blocks")
            index.record(replica.name, [vllm_namespace(BLOCK).chunk_hashes(list(range(900, 904)))[0]])
            assert RECENT in index.chunks(replica.name)
            publisher.send(op="restart")
            publisher.send(op="batch", events=[stored([3], None, prompt[:4])])
            await until(lambda: counts.get("restart") == 1 and index.cached(replica.name, keys) == {"GPU": 1},
                        "the restart")
            assert RECENT not in index.chunks(replica.name)
            replica.stop_events()  # ejected: what the index knew of it is freed
            assert index.chunks(replica.name) == {}
        finally:
            await replica.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_a_100k_event_batch_is_decoded_and_applied_in_slices_with_the_loop_served_between(publisher):
    """A batch of 100,000 one-block stores from a real publisher socket: another task of the loop runs between
    every slice of at most ``keys_per_turn`` keys (it sees the index part-way, never the batch in one turn), and
    the whole batch reaches the index, ``next_seq`` moving on only after its last slice."""
    n, budget = 100_000, 2_048
    index = FleetIndex(max_total_keys=2 * n, replicas=1)
    sink = VllmReplicaIndex(index.holdings("r"), BLOCK, MEDIA)
    sizes: list[int] = []
    applied = sink.apply

    def apply(batch) -> None:
        sizes.append(len(batch.events))
        applied(batch)

    sink.apply = apply  # type: ignore[method-assign]
    counts: dict[str, int] = {}
    ctx = zmq.asyncio.Context()
    subscriber = VllmEventSubscriber(ctx, publisher.endpoint, publisher.replay, "kv@", sink,
                                     VllmSubscriberConfig(keys_per_turn=budget),
                                     lambda what: counts.__setitem__(what, counts.get(what, 0) + 1))
    turns: list[tuple[int, int | None]] = []  # (events applied, next_seq) at each turn of the other task

    async def main():
        task = asyncio.ensure_future(subscriber.run())

        async def tick() -> None:
            while True:
                turns.append((sum(sizes), subscriber.next_seq))
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        try:
            await asyncio.sleep(0.3)  # the SUB socket connects (ZMQ's slow joiner)
            publisher.send(op="flood", n=n, block_size=BLOCK)
            await until(lambda: counts.get("batch", 0) >= 1, "the flood", timeout=600)  # a bound, not a speed
        finally:
            for t in (task, ticker):
                t.cancel()
            await asyncio.gather(task, ticker, return_exceptions=True)
            ctx.destroy(linger=0)

    asyncio.run(main())
    assert sum(sizes) == n and max(sizes) <= budget and len(sizes) >= n // budget
    seen = {done for done, _ in turns if 0 < done < n}
    assert len(seen) >= len(sizes) - 1  # the other task ran after every slice but the last
    assert all(seq is None for done, seq in turns if done < n)
    assert index.chunks("r")["GPU"] == n and subscriber.next_seq == 1
