"""The connector's asynchronous loads and lookups, with real kvtier caches and vLLM's own result aggregation.

Tensor parallelism cannot run on this CPU build, so ranks finishing at different times are two AsyncLoads
(one per rank, each with its cache and paged tensors) whose answers go through vLLM's KVOutputAggregator, as
vLLM's executor does with its workers' outputs.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from kvtier import CacheConfig, KVCache  # noqa: E402
from kvtier.base.keys import NO_EXTRAS  # noqa: E402
from kvtier.integrations.vllm.loader import AsyncLoads  # noqa: E402
from kvtier.integrations.vllm.lookup import LookupClient, LookupServer, socket_path  # noqa: E402
from kvtier.integrations.vllm.lookups import Lookups  # noqa: E402
from kvtier.integrations.vllm.metadata import LoadSpec, pack_tokens  # noqa: E402
from kvtier.integrations.vllm.paged import PagedKV, PagedSource  # noqa: E402

BLOCKS, HEADS, BS, DIM, LAYERS, CHUNK = 16, 2, 32, 16, 2, 64
TOKENS = list(range(1000, 1256))  # four chunks


def rank(stored: torch.Tensor | None = None) -> tuple[PagedKV, KVCache]:
    """One rank's paged KV (CPU backend layout) and cache, holding TOKENS' KV from ``stored`` blocks 0-7."""
    layers = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    paged = PagedKV(layers, BS, rows_split=True)
    cache = KVCache(paged.spec, "m@1", CacheConfig(chunk_size=CHUNK))
    source = PagedKV([torch.randn(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)], BS, rows_split=True)
    cache.store(TOKENS, PagedSource(source, list(range(8))))
    return paged, cache


def spec(timeout_s: float = 30.0) -> LoadSpec:
    return LoadSpec("r", pack_tokens(TOKENS), b"", list(range(8, 16)), first_token=0, end=255, timeout_s=timeout_s)


def gate(cache: KVCache) -> threading.Event:
    """The cache's reads wait until the returned event is set."""
    tier, released = cache.tiers[0], threading.Event()
    original = tier.get

    def get(keys):
        released.wait(30)
        return original(keys)

    tier.get = get
    return released


def poll(loads: AsyncLoads, until, finished=None, limit_s: float = 30.0) -> tuple[set[str], set[int]]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, bad = loads.finished(finished)
        if until(done):
            return done, bad
        time.sleep(0.01)
    raise AssertionError("no load finished in time")


def output(done: set[str], bad: set[int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], req_id_to_index={},
                             kv_connector_output=KVConnectorOutput(finished_recving=done or None,
                                                                   invalid_block_ids=bad))


def test_tp_ranks_finishing_at_different_times():
    (paged0, cache0), (paged1, cache1) = rank(), rank()
    cache1.tiers[0].delete([cache1.keys(TOKENS)[2]])  # rank 1 lost chunk 2 since the lookup
    released = gate(cache1)
    loads0, loads1 = AsyncLoads(paged0, cache0, 30.0), AsyncLoads(paged1, cache1, 30.0)
    aggregator = KVOutputAggregator(expected_finished_count=2)
    try:
        loads0.submit(spec())
        loads1.submit(spec())
        done0, bad0 = poll(loads0, bool)
        assert (done0, bad0) == ({"r"}, set())
        out = aggregator.aggregate([output(done0, bad0), output(*loads1.finished())]).kv_connector_output
        assert not out.finished_recving  # rank 1 still loading: vLLM keeps waiting
        assert torch.equal(paged0.gather(list(range(8, 16)), 0, 256), cache0.retrieve(TOKENS)[0])
        released.set()
        done1, bad1 = poll(loads1, bool)
        assert done1 == {"r"} and bad1 == {12, 13, 14, 15}  # chunk 2 and after: blocks 4-7 of the request
        out = aggregator.aggregate([output(*loads0.finished()), output(done1, bad1)]).kv_connector_output
        assert out.finished_recving == {"r"} and out.invalid_block_ids == {12, 13, 14, 15}
    finally:
        released.set()
        loads0.close()
        loads1.close()


def test_deadline_and_abort_close_the_sink_before_reporting():
    paged, cache = rank()
    released = gate(cache)
    loads = AsyncLoads(paged, cache, 30.0)
    try:
        loads.submit(spec(timeout_s=0.2))
        done, bad = poll(loads, bool)
        assert done == {"r"} and bad == set(range(8, 16))  # nothing arrived in time: every block recomputed
        released.set()
        time.sleep(0.5)  # the retrieve goes on in the tier, and must not write into the blocks it lost
        assert not any(layer[16:].any() for layer in paged.views)
        assert loads.finished() == (set(), set())  # reported once
        released.clear()
        loads.submit(spec())
        assert loads.finished({"r"})[0] == {"r"}  # vLLM finished (aborted) the request
        assert loads.totals["deadline"] == 1 and loads.totals["aborted"] == 1
    finally:
        released.set()
        loads.close()


def test_lookup_past_its_deadline_is_a_miss_and_answers_are_cached(tmp_path):
    paged, cache = rank()
    slow, calls = threading.Event(), []
    original = cache.lookup

    def lookup(tokens, salt=b"", extras=NO_EXTRAS):
        calls.append(len(tokens))
        if slow.is_set():
            time.sleep(1.0)
        return original(tokens, salt=salt, extras=extras)

    cache.lookup = lookup
    path = socket_path(str(tmp_path), "engine", 0)
    server = LookupServer(cache, path)
    lookups = Lookups(LookupClient([path]), timeout_s=0.3)
    try:
        assert lookups.answer("a", TOKENS, b"") == 256
        assert lookups.answer("a", TOKENS, b"") == 256 and len(calls) == 1  # cached
        lookups.changed()
        assert lookups.answer("a", TOKENS, b"") == 256 and len(calls) == 2  # the cache changed: asked again
        slow.set()
        assert lookups.answer("b", TOKENS, b"") == 0  # not answered within 0.3 s: a miss
        time.sleep(1.0)
        assert lookups.answer("b", TOKENS, b"") == 0  # and stays one until the cache changes
        slow.clear()
        lookups.changed()
        assert lookups.answer("b", TOKENS, b"") == 256
    finally:
        lookups.close()
        server.close()


def test_loads_run_at_the_configured_niceness_and_read_only_what_vllm_lacks():
    """The threads that read a load's chunks run at ``nice`` (the engine's own threads keep theirs); a load whose
    first chunk vLLM already holds reads from the next chunk on."""
    import os

    paged, cache = rank()
    tier, seen = cache.tiers[0], []
    original = tier.get

    def get(keys):
        seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), len(keys)))
        return original(keys)

    tier.get = get
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    loads = AsyncLoads(paged, cache, 30.0, nice=min(mine + 7, 19))
    try:
        loads.submit(LoadSpec("r", pack_tokens(TOKENS), b"", list(range(8, 16)), first_token=64, end=255,
                              timeout_s=30.0))
        assert poll(loads, bool) == ({"r"}, set())
        assert seen and all(nice == min(mine + 7, 19) for nice, _ in seen)
        assert sum(n for _, n in seen) == 3  # chunks 1-3: vLLM holds chunk 0
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
        assert not paged.views[0][8:10].any()  # blocks of vLLM's own hit left alone
        assert torch.equal(paged.gather(list(range(8, 16)), 64, 256), cache.retrieve(TOKENS)[0][:, :, 64:])
    finally:
        loads.close()


def test_a_starved_niced_load_gets_the_engines_priority_back():
    import os

    paged, cache = rank()
    released = gate(cache)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    loads = AsyncLoads(paged, cache, 30.0, nice=min(mine + 7, 19))
    try:
        loads.submit(spec(timeout_s=1.0))
        tid = loads._thread.native_id
        deadline = time.monotonic() + 5
        while os.getpriority(os.PRIO_PROCESS, tid) != min(mine + 7, 19) and time.monotonic() < deadline:
            time.sleep(0.01)  # the thread nices itself when it starts
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(mine + 7, 19)
        time.sleep(0.3)  # past a quarter of the load's 1 s
        loads.finished()
        if os.geteuid() != 0:
            pytest.skip("lowering a niceness needs root or CAP_SYS_NICE")
        assert os.getpriority(os.PRIO_PROCESS, tid) == mine and loads.nice == 0
        released.set()
        assert poll(loads, bool) == ({"r"}, set())
    finally:
        released.set()
        loads.close()
