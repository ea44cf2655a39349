"""Loads larger than the Mooncake tier's transfer buffer, against a real mooncake_master: the tier moves a get or
put larger than the buffer in slices that fit, a slice that fails is a miss for its own values only, the cache
cuts its reads into gets that fit (BoundedGets), concurrent gets queue for the buffer instead of missing, and a
value larger than the whole buffer is a miss at once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.metrics import Metrics
from kvtier.base.state import ModelStateSpec, StateKind, StateSpec
from kvtier.codecs import BytesPayload
from kvtier.core.bounded import blob_bytes
from kvtier.core.segments import SegmentCache
from kvtier.tiers import BoundedGets, MooncakeTier, TierContext
from harness.mooncake_master import MooncakeMaster, SegmentHost
from harness.process import wait_for
from tests.tiers.mooncake.conftest import require_mooncake
from tests.tiers.mooncake.helpers import MiB, tier_config

SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=64, dtype=torch.float16)  # 8 KiB of KV per token
CHUNK = 64  # 512 KiB chunks
TWO_CHUNKS = 2 * blob_bytes(SPEC, CHUNK) + blob_bytes(SPEC, CHUNK) // 2  # room for two chunks, not three
HANG_GUARD_S = 120.0


@pytest.fixture
def master(mooncake_master):
    yield mooncake_master
    assert mooncake_master.keys() == [], "a test left values in the pool (a tier was not closed)"


def small_cache(master, *, model: str = "split@1") -> KVCache:
    return KVCache(SPEC, model, CacheConfig(chunk_size=CHUNK, tiers=(tier_config(master, buffer_bytes=TWO_CHUNKS),)))


def no_buffer(cache: KVCache) -> float:
    return cache.metrics.get("kvtier_mooncake_no_buffer_total", tier=cache.tiers[0].name)


def test_a_load_of_eight_chunks_through_a_buffer_of_two_is_all_hits(master):
    """Stores and the load's windows are cut to two chunks; the windows run concurrently and queue for the
    buffer, so every chunk arrives, bytes equal, and none missed for want of buffer."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50_000, (8 * CHUNK,), generator=gen).tolist()
    kv = torch.randn(SPEC.chunk_shape(len(tokens)), generator=gen).to(SPEC.dtype)
    with small_cache(master) as cache:
        tier = cache.tiers[0]
        assert isinstance(tier, BoundedGets) and cache.chain.pipeline.per_get(tier) == 2
        assert cache.store(tokens, kv) == len(tokens)
        out, n = cache.retrieve(tokens)
        assert n == len(tokens) and torch.equal(out, kv)
        assert no_buffer(cache) == 0
        assert cache.metrics.total("kvtier_skipped_stores_total") == 0
        assert tier._buffers.largest_free == tier._buffers.registered_bytes  # every lease handed back


def test_segments_larger_than_the_buffer_together_are_read_in_gets_that_fit(master):
    """The chain's whole-entry reads (segments here) are cut the same way: five one-chunk segments, two a get."""
    gen = torch.Generator().manual_seed(2)
    segs = [torch.randint(0, 50_000, (CHUNK,), generator=gen).tolist() for _ in range(5)]
    kvs = [torch.randn(SPEC.chunk_shape(CHUNK), generator=gen).to(SPEC.dtype) for _ in segs]
    with small_cache(master, model="segments@1") as cache:
        seg = SegmentCache(cache)
        assert all(seg.store(s, kv) for s, kv in zip(segs, kvs))
        got = seg.retrieve(segs)
        assert all(g is not None and torch.equal(g, kv) for g, kv in zip(got, kvs))
        assert no_buffer(cache) == 0


def values_of(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def test_a_64_mib_get_and_put_through_a_16_mib_buffer(master):
    """One put and one get of 64 MiB through a 16 MiB transfer buffer: moved in slices, every value stored and
    read back byte for byte, the buffer's room all handed back, and the spill memory kept for the next one."""
    values = values_of(16, 4 * MiB - 4096, seed=4)
    keys = [bytes([i]) * 32 for i in range(16)]
    with SegmentHost(master, 96 * MiB):
        tier = MooncakeTier(tier_config(master, buffer_bytes=16 * MiB, segment_bytes=0),
                            TierContext(SPEC, Metrics(), "mooncake"))
        try:
            assert tier.put([(k, BytesPayload(v)) for k, v in zip(keys, values)]) == [True] * 16
            for _ in range(2):  # the second get reuses the first one's spill memory
                with tier.get(keys) as got:
                    assert [None if v is None else bytes(v) for v in got] == values
                assert tier._spill.spare_bytes >= 48 * MiB
            assert tier._metrics.get("kvtier_mooncake_no_buffer_total", tier="mooncake") == 0
            assert tier._metrics.total("kvtier_skipped_stores_total") == 0
            assert tier._buffers.largest_free == 16 * MiB
            tier.delete(keys)
        finally:
            tier.close()


def test_a_slice_whose_holder_died_is_a_miss_for_its_values_only():
    """64 MiB read in four slices of 16 MiB; the second slice's values live on a replica that is then killed
    (the master keeps their metadata: its client TTL is long), so that slice's transfer fails. Its values are
    misses; the other slices' arrive byte for byte."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    require_mooncake()
    values = values_of(16, 4 * MiB - 4096, seed=5)
    keys = [bytes([i]) * 32 for i in range(16)]
    doomed = range(4, 8)  # the second slice of four
    with MooncakeMaster(args=("--client_ttl=300",)) as master, SegmentHost(master, 64 * MiB) as kept, \
            SegmentHost(master, 32 * MiB) as dying:
        tier = MooncakeTier(tier_config(master, buffer_bytes=16 * MiB, segment_bytes=0),
                            TierContext(SPEC, Metrics(), "mooncake"))
        writer = MooncakeDistributedStore()  # places each value on the replica the test names
        assert writer.setup("127.0.0.1", master.metadata_url, 0, 16 * MiB, "tcp", "", master.master_address) == 0
        try:
            src = np.frombuffer(b"".join(values), dtype=np.uint8).copy()
            assert writer.register_buffer(src.ctypes.data, src.nbytes) == 0
            names = tier._names(keys)
            for i, name in enumerate(names):
                config = ReplicateConfig()
                config.preferred_segment = dying.segment if i in doomed else kept.segment
                size = len(values[i])
                assert writer.batch_put_from([name], [src.ctypes.data + i * size], [size], config) == [0]
            where = writer.batch_get_replica_desc(names)
            held = [where[n][0].get_memory_descriptor().buffer_descriptor.transport_endpoint for n in names]
            assert [h == dying.segment for h in held] == [i in doomed for i in range(16)], held
            dying.proc.kill()
            dying.proc.wait()
            with tier.get(keys) as got:
                got = [None if v is None else bytes(v) for v in got]
            assert got == [None if i in doomed else v for i, v in enumerate(values)]
            assert tier._buffers.largest_free == 16 * MiB
        finally:
            writer.close()
            tier.close()


def test_concurrent_gets_beyond_the_buffer_queue_and_all_arrive(master):
    values = [bytes([i + 1]) * (400 << 10) for i in range(8)]  # two fit the 1 MiB buffer at once
    keys = [bytes([i]) * 32 for i in range(8)]
    tier = MooncakeTier(tier_config(master, buffer_bytes=MiB), TierContext(SPEC, Metrics(), "mooncake"))
    try:
        assert tier.put([(k, BytesPayload(v)) for k, v in zip(keys, values)][:2]) == [True, True]
        assert tier.put([(k, BytesPayload(v)) for k, v in zip(keys, values)][2:4]) == [True, True]
        done = []

        def read(pair: int) -> list[bytes | None]:
            with tier.get(keys[2 * pair : 2 * pair + 2]) as got:
                return [None if v is None else bytes(v) for v in got]

        with tier.get(keys[:2]) as held:  # the whole buffer is taken: the next get waits for it
            waiter = threading.Thread(target=lambda: done.append(read(1)))
            waiter.start()
            assert wait_for(lambda: tier._buffers.waited == 1)
            assert [bytes(v) for v in held] == values[:2] and not done
        waiter.join(HANG_GUARD_S)
        assert done == [values[2:4]]
        for start in (4, 6):
            assert tier.put([(k, BytesPayload(v)) for k, v in zip(keys[start:start + 2], values[start:start + 2])])
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(read, range(4))) == [values[2 * p : 2 * p + 2] for p in range(4)]
        assert tier._metrics.get("kvtier_mooncake_no_buffer_total", tier="mooncake") == 0
        tier.delete(keys)
    finally:
        tier.close()


def test_a_value_larger_than_the_buffer_is_a_miss_at_once(master):
    key, value = b"L" * 32, b"v" * (3 * MiB // 2)
    ctx = TierContext(SPEC, Metrics(), "mooncake")
    small = MooncakeTier(tier_config(master, buffer_bytes=MiB, segment_bytes=0), ctx)
    large = MooncakeTier(tier_config(master, buffer_bytes=4 * MiB), TierContext(SPEC, Metrics(), "mooncake"))
    try:
        assert large.put([(key, BytesPayload(value))]) == [True]
        with small.get([key]) as got:
            assert got == [None]
        assert small._metrics.get("kvtier_mooncake_no_buffer_total", tier="mooncake") == 1
        assert small._buffers.waited == 0
        large.delete([key])
    finally:
        small.close()
        large.close()


def test_state_snapshots_larger_together_than_the_buffer_are_stored_and_read_one_a_get(master):
    """A boundary's snapshot is one entry per state kind, and a state's size is not its tokens' KV: stores are cut
    by the blobs' sizes and reads take one snapshot a get, so both kinds arrive through a buffer that holds one."""
    conv = StateSpec(StateKind.CONV, 2, (1024, 96), torch.float32)  # 768 KiB a snapshot
    ssm = StateSpec(StateKind.SSM, 2, (12, 64, 128), torch.float32)  # 768 KiB
    spec = ModelStateSpec(None, (conv, ssm))
    config = CacheConfig(chunk_size=CHUNK, state_snapshots="every",
                         tiers=(tier_config(master, buffer_bytes=(1 << 20) + (1 << 18)),))  # holds one, not two
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50_000, (2 * CHUNK,), generator=gen).tolist()
    snaps = {b: {StateKind.CONV: torch.randn(conv.snapshot_shape, generator=gen),
                 StateKind.SSM: torch.randn(ssm.snapshot_shape, generator=gen)} for b in (1, 2)}
    with KVCache(spec, "states@1", config) as cache:
        assert cache.store_states(tokens, snaps) == 2
        assert cache.metrics.total("kvtier_skipped_stores_total") == 0
        prefix = cache.retrieve_states(tokens)
        assert prefix.tokens == 2 * CHUNK
        assert all(torch.equal(prefix.states[kind], snaps[2][kind]) for kind in snaps[2])
        assert no_buffer(cache) == 0
