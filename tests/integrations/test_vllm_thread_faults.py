"""The vLLM connector's long-lived threads (save, load, lookups) outlive what one request's work raises.

Each test injects one exception into the real cache or client a thread calls (the connector's real classes,
real KVCache, real paged tensors, a real Unix lookup socket): that request fails alone (a save counted done with
nothing stored, a load whose blocks are recomputed, a lookup that is a miss) and the next request is served.
"""

from __future__ import annotations

import time

import torch

from kvtier import CacheConfig, KVCache
from kvtier.integrations.vllm.loader import AsyncLoads
from kvtier.integrations.vllm.lookup import LookupClient, LookupServer, socket_path
from kvtier.integrations.vllm.lookups import Lookups
from kvtier.integrations.vllm.metadata import LoadSpec, SaveSpec, pack_tokens
from kvtier.integrations.vllm.paged import PagedKV, PagedSource
from kvtier.integrations.vllm.worker import WorkerSide
from tests.integrations.test_vllm_parts import cpu_layers

BLOCKS, HEADS, BS, DIM, LAYERS, CHUNK = 16, 2, 32, 16, 2, 64
TOKENS = list(range(1000, 1256))  # four chunks


def rank() -> tuple[PagedKV, KVCache]:
    """A rank's paged KV (CPU backend layout) and a cache holding TOKENS' KV."""
    paged = PagedKV([torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)], BS, rows_split=True)
    cache = KVCache(paged.spec, "m@1", CacheConfig(chunk_size=CHUNK))
    source = PagedKV([torch.randn(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)], BS, rows_split=True)
    cache.store(TOKENS, PagedSource(source, list(range(8))))
    return paged, cache


def poll(loads: AsyncLoads, limit_s: float = 30.0) -> tuple[set[str], set[int]]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, bad = loads.finished()
        if done:
            return done, bad
        time.sleep(0.01)
    raise AssertionError("no load finished in time")


def fails_once(obj, name: str):
    """Make ``obj.name`` raise ZeroDivisionError on its first call only (an injected bug in one request)."""
    original, calls = getattr(obj, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError(f"injected: {name} fails for one request")
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


def test_a_save_that_raises_is_reported_done_with_nothing_stored_and_the_next_is_saved(tmp_path):
    paged = PagedKV(cpu_layers(), 32, rows_split=True)
    cache = KVCache(paged.spec, "m@1", CacheConfig(chunk_size=64))
    worker = WorkerSide(paged, cache, socket_path(str(tmp_path), "engine", 0), max_lookup_tokens=4096)
    try:
        fails_once(cache, "store")
        tokens = pack_tokens(list(range(128)))
        worker.submit_saves([SaveSpec("a", 1, tokens, b"", list(range(4)))], delayed=["a"])
        deadline = time.monotonic() + 30
        while "a" not in worker.finished_saves():  # vLLM may free the blocks: the job is over
            assert time.monotonic() < deadline, "the failed save was never reported"
            time.sleep(0.01)
        assert cache.lookup(list(range(128))) == 0
        worker.submit_saves([SaveSpec("b", 2, tokens, b"", list(range(4)))], delayed=["b"])
        while "b" not in worker.finished_saves():
            assert time.monotonic() < deadline, "the next save was never reported"
            time.sleep(0.01)
        assert cache.lookup(list(range(128))) == 128
        assert worker._saver.is_alive() and worker.take_counts()["stored_tokens"] == 128
    finally:
        worker.close()


def test_a_load_that_raises_is_recomputed_and_the_next_load_arrives():
    paged, cache = rank()
    loads = AsyncLoads(paged, cache, 30.0)
    try:
        fails_once(cache, "retrieve_keyed")
        spec = LoadSpec("a", pack_tokens(TOKENS), b"", list(range(8, 16)), first_token=0, end=255)
        loads.submit(spec)
        done, bad = poll(loads)
        assert done == {"a"} and bad == set(range(8, 16))  # nothing verified arrived: every block recomputed
        loads.submit(LoadSpec("b", pack_tokens(TOKENS), b"", list(range(8, 16)), first_token=0, end=255))
        done, bad = poll(loads)
        assert done == {"b"} and bad == set()
        assert loads._thread.is_alive()
    finally:
        loads.close()


def test_a_lookup_that_raises_in_the_scheduler_is_a_miss_and_the_next_is_answered(tmp_path):
    paged, cache = rank()
    worker_socket = socket_path(str(tmp_path), "engine", 0)
    server = LookupServer(cache, worker_socket)
    client = LookupClient([worker_socket])
    lookups = Lookups(client, timeout_s=10)
    try:
        fails_once(client, "lookup")
        assert lookups.answer("a", TOKENS, b"") == 0
        assert lookups.answer("b", TOKENS, b"") == len(TOKENS) // CHUNK * CHUNK
        assert lookups._thread.is_alive()
    finally:
        lookups.close()
        server.close()
