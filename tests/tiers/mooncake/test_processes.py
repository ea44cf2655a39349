"""Replicas in separate processes share one Mooncake pool: each contributes what it can spare, every chunk
stored by one is a hit for the others, and the chunks a replica holds are misses once it hangs, crashes or
leaves (within the deadline, never errors)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.process import timed, wait_for
from tests.tiers.mooncake.conftest import CLIENT_TTL_S
from tests.tiers.mooncake.helpers import CHUNK, MiB, make_cache, prompt

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 1.0
HANG = 30.0  # far past the deadline: only a read that never returns gets here (no timing asserted)
REPLICA = Path(__file__).with_name("replica.py")


class Replica:
    """A KVCache with a mooncake tier in its own interpreter (tests/tiers/mooncake/replica.py)."""

    def __init__(self, master, **options) -> None:
        options["master"] = [master.master_address, master.metadata_url, master.metrics_url]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR"}
        self.proc = subprocess.Popen([sys.executable, str(REPLICA), json.dumps(options)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def wait_ready(self) -> None:
        assert self._reply() == {"ready": True}

    def ask(self, op: str, seed: int, chunks: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "seed": seed, "chunks": chunks}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"replica exited ({self.proc.returncode}): {self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def exit(self) -> None:
        """Leave cleanly: the cache closes, the segment is unmounted."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def replicas():
    started: list[Replica] = []

    def start(master, **options) -> Replica:
        replica = Replica(master, **options)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        if replica.proc.poll() is None:
            replica.kill()


def test_three_replicas_with_different_segments_share_chunks(own_master, replicas):
    sizes = (16 * MiB, 32 * MiB, 64 * MiB)
    group = [replicas(own_master, segment_bytes=size) for size in sizes]
    for replica in group:  # started together, joined one by one
        replica.wait_ready()
    assert own_master.metrics()["master_total_capacity_bytes"] == sum(sizes)  # one pool of all three
    for seed, replica in enumerate(group):
        assert replica.ask("store", seed, 4) == {"stored": 4 * CHUNK}
    for me, replica in enumerate(group):
        for seed in range(len(group)):
            assert replica.ask("retrieve", seed, 4) == {"tokens": 4 * CHUNK, "same": True}, (me, seed)
            if seed != me:  # another replica's chunks: nothing left to store
                assert replica.ask("store", seed, 4) == {"stored": 0}
    assert own_master.metrics()["master_key_count"] == 3 * 4


def test_chunks_of_a_frozen_crashed_or_departed_replica_are_misses(own_master, replicas):
    # the holders are the only replicas contributing memory: every chunk lands in one of their segments
    killed = replicas(own_master, segment_bytes=32 * MiB)
    killed.wait_ready()
    with make_cache(own_master, segment_bytes=0, timeout_s=TIMEOUT) as reader:
        assert killed.ask("store", 1, 4) == {"stored": 4 * CHUNK}
        tokens, _ = prompt(4, seed=1)
        assert reader.retrieve(tokens)[1] == 4 * CHUNK
        os.kill(killed.proc.pid, signal.SIGSTOP)  # frozen: transfers from it never complete
        try:
            result, seconds = timed(reader.retrieve, tokens)
            assert result[1] == 0 and seconds < HANG  # a miss once the deadline passes, not a hang
        finally:
            os.kill(killed.proc.pid, signal.SIGCONT)
        assert reader.metrics.get("kvtier_tier_errors_total", tier="mooncake", op="get") == 1
        killed.kill()
        # its segment is unreachable at once: reads fail fast and are misses, never errors or wrong bytes
        result, seconds = timed(reader.retrieve, tokens)
        assert result[1] == 0 and seconds < HANG
        # the master drops the silent replica after its client TTL: then lookups say miss too
        assert wait_for(lambda: reader.lookup(tokens) == 0, CLIENT_TTL_S + 10)
        assert own_master.metrics()["master_total_capacity_bytes"] == 0

        leaving = replicas(own_master, segment_bytes=32 * MiB)
        leaving.wait_ready()
        assert reader.store(tokens, prompt(4, seed=1)[1]) == 4 * CHUNK  # into the new replica's segment
        assert reader.lookup(tokens) == 4 * CHUNK
        leaving.exit()  # a clean exit unmounts its segment: its chunks are gone at once
        assert reader.lookup(tokens) == 0
        assert reader.retrieve(tokens)[1] == 0
        # no segment left in the pool: stores are skipped, not errors
        assert reader.store(tokens, prompt(4, seed=1)[1]) == 0
        assert reader.metrics.get("kvtier_skipped_stores_total", tier="mooncake", reason="pool_full") == 4
        assert reader.metrics.total("kvtier_tier_errors_total") == 1  # the frozen read, nothing since

