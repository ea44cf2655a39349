"""KVCache for models with SSM state: a hit needs every kind, broken snapshots are misses, tenants stay apart."""

import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.errors import ConfigError
from kvtier.base.state import ModelStateSpec, StateKind, StateSpec, state_key
from kvtier.codecs import BytesPayload
from kvtier.core.events import ChunkEventKind, EntryKind
from kvtier.core.jobs import PipelineTuning
from kvtier.tiers import DiskTierConfig, MemoryTierConfig, WriteMode

CHUNK = 16
KV = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
CONV = StateSpec(StateKind.CONV, 3, (24, 4), torch.float32)
SSM = StateSpec(StateKind.SSM, 3, (4, 8, 8), torch.float32)
HYBRID = ModelStateSpec(KV, (CONV, SSM))
PURE_SSM = ModelStateSpec(None, (CONV, SSM))


def make(spec=HYBRID, *tiers, adapter="", snapshots="every", tuning=None):
    tiers = tiers or (MemoryTierConfig(capacity_bytes=8 << 20, prefault=False),)
    return KVCache(spec, "hybrid@1", CacheConfig(chunk_size=CHUNK, tiers=tiers, state_snapshots=snapshots),
                   adapter=adapter, tuning=tuning)


def tokens(n, seed=0):
    return [(seed * 7919 + 31 * i) % 50000 for i in range(n)]


def kv(n, seed=0):
    return torch.randn(KV.chunk_shape(n), generator=torch.Generator().manual_seed(seed))


def snapshot(boundary, seed=0):
    """A distinct snapshot per boundary, so a restore at the wrong boundary cannot pass for the right one."""
    gen = torch.Generator().manual_seed(seed * 1000 + boundary)
    return {StateKind.CONV: torch.randn(CONV.snapshot_shape, generator=gen),
            StateKind.SSM: torch.randn(SSM.snapshot_shape, generator=gen)}


def fill(cache, toks, boundaries, seed=0, salt=b""):
    if cache.spec is not None:
        cache.store(toks, kv(len(toks), seed), salt=salt)
    return cache.store_states(toks, {k: snapshot(k, seed) for k in boundaries}, salt=salt)


def assert_restored(prefix, toks, boundary, seed=0):
    assert prefix.tokens == boundary * CHUNK
    want = snapshot(boundary, seed)
    assert all(torch.equal(prefix.states[kind], want[kind]) for kind in want)
    if prefix.kv is not None:
        assert torch.equal(prefix.kv, kv(len(toks), seed)[:, :, : boundary * CHUNK])


def test_hit_at_the_last_boundary_with_kv_and_state():
    cache = make()
    toks = tokens(100)  # 6 full chunks
    assert fill(cache, toks, [2, 6]) == 2
    assert cache.lookup(toks) == 6 * CHUNK
    assert cache.lookup(toks[:90]) == 2 * CHUNK  # 5 full chunks: the snapshot at 5 does not exist
    assert_restored(cache.retrieve_states(toks), toks, 6)
    assert_restored(cache.retrieve_states(toks, max_tokens=6 * CHUNK - 1), toks, 2)
    assert cache.metrics.get("kvtier_state_snapshots_stored_total", tier="memory") == 4  # 2 boundaries x 2 kinds


def test_kv_without_its_state_is_not_a_hit():
    cache = make()
    toks = tokens(64)
    cache.store(toks, kv(64))
    assert cache.lookup(toks) == 0
    assert cache.retrieve_states(toks).tokens == 0


def test_state_without_its_kv_is_not_a_hit():
    cache = make()
    toks = tokens(64)
    cache.store_states(toks, {4: snapshot(4)})
    assert cache.lookup(toks) == 0
    cache.store(toks[:32], kv(32))  # KV of chunks 1-2 only: the snapshot at 4 is still unusable
    assert cache.lookup(toks) == 0
    assert cache.retrieve_states(toks).tokens == 0


def test_one_kind_missing_is_not_a_hit():
    cache = make()
    toks = tokens(64)
    fill(cache, toks, [2, 4])
    cache.tiers[0].delete([state_key(cache.keys(toks)[3], StateKind.SSM)])
    assert cache.lookup(toks) == 2 * CHUNK
    assert_restored(cache.retrieve_states(toks), toks, 2)


def test_pure_ssm_model_needs_only_the_snapshot():
    cache = make(PURE_SSM)
    toks = tokens(80)
    fill(cache, toks, [3])
    assert cache.lookup(toks) == 3 * CHUNK
    prefix = cache.retrieve_states(toks)
    assert prefix.kv is None
    assert_restored(prefix, toks, 3)
    with pytest.raises(ConfigError):
        cache.store(toks, kv(80))
    with pytest.raises(ConfigError):
        cache.retrieve(toks)


def test_corrupt_snapshot_is_a_counted_miss_and_falls_back_to_a_lower_boundary():
    cache = make()
    toks = tokens(64)
    fill(cache, toks, [2, 4])
    key = state_key(cache.keys(toks)[3], StateKind.SSM)
    with cache.tiers[0].get([key]) as (blob,):
        blob[len(blob) - 3] ^= 0x40  # a bit of the state itself: only a sealed tier's checksum sees this
        blob[40 + 4 * 4] ^= 0xFF  # a token id in the header: every tier checks these
    assert_restored(cache.retrieve_states(toks), toks, 2)
    assert cache.metrics.get("kvtier_corrupt_chunks_total", tier="memory") == 1
    assert cache.tiers[0].contains([key]) == [False]  # deleted
    assert cache.lookup(toks) == 2 * CHUNK


def test_bit_flip_in_a_sealed_snapshot_is_caught_by_the_checksum(tmp_path):
    cache = make(HYBRID, DiskTierConfig(path=tmp_path, capacity_bytes=8 << 20, fsync=False))
    toks = tokens(64)
    fill(cache, toks, [4])
    cache.tiers[0].flush()
    key = state_key(cache.keys(toks)[3], StateKind.CONV)
    files = [p for p in tmp_path.rglob("*") if p.is_file() and key.hex() in p.name]
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[-5] ^= 0x01  # one bit of the stored state
    files[0].write_bytes(bytes(data))
    assert cache.retrieve_states(toks).tokens == 0
    assert cache.metrics.get("kvtier_corrupt_chunks_total", tier="disk") == 1


def test_snapshot_of_another_shape_is_a_miss():
    cache = make()
    toks = tokens(32)
    fill(cache, toks, [2])
    other = make(ModelStateSpec(KV, (StateSpec(StateKind.CONV, 3, (24, 8), torch.float32), SSM)))
    wrong = {StateKind.CONV: torch.zeros(3, 24, 8), StateKind.SSM: snapshot(2)[StateKind.SSM]}
    other.store_states(toks, {2: wrong})
    # planted under this cache's key (same tier bytes, another spec): decodes to the wrong shape
    key = state_key(cache.keys(toks)[1], StateKind.CONV)
    with other.tiers[0].get([state_key(other.keys(toks)[1], StateKind.CONV)]) as (blob,):
        planted = bytes(blob)
    cache.tiers[0].delete([key])
    cache.tiers[0].put([(key, BytesPayload(planted))])
    assert cache.retrieve_states(toks).tokens == 0
    assert cache.metrics.get("kvtier_corrupt_chunks_total", tier="memory") == 1


def test_corrupt_kv_chunk_caps_the_boundary():
    cache = make()
    toks = tokens(64)
    fill(cache, toks, [1, 2, 3, 4])
    with cache.tiers[0].get([cache.keys(toks)[2]]) as (blob,):
        blob[40 + 4 * 5] ^= 0xFF  # chunk 3's tokens
    assert_restored(cache.retrieve_states(toks), toks, 2)


def test_tenants_and_adapters_stay_apart():
    cache = make()
    toks = tokens(64)
    fill(cache, toks, [4], salt=b"alice")
    assert cache.lookup(toks, salt=b"alice") == 64
    assert cache.lookup(toks, salt=b"bob") == 0 and cache.lookup(toks) == 0
    assert cache.retrieve_states(toks, salt=b"bob").tokens == 0
    lora = make(adapter="lora-a")
    fill(lora, toks, [4])
    assert lora.lookup(toks) == 64
    base_keys = make().keys(toks)  # what the base model would look up, in the tier holding lora-a's entries
    wanted = base_keys + [state_key(base_keys[3], kind) for kind in (StateKind.CONV, StateKind.SSM)]
    assert lora.tiers[0].contains(wanted) == [False] * len(wanted)


def test_lossy_codecs_are_refused_for_state_but_not_for_kv_only_models():
    with pytest.raises(ConfigError, match="lossy"):
        make(HYBRID, MemoryTierConfig(capacity_bytes=1 << 20, codec="int8", prefault=False))
    with pytest.raises(ConfigError, match="lossy"):
        make(HYBRID, MemoryTierConfig(capacity_bytes=1 << 20, prefault=False),
             MemoryTierConfig(capacity_bytes=1 << 20, codec="cachegen", prefault=False))
    make(KV, MemoryTierConfig(capacity_bytes=1 << 20, codec="int8", prefault=False)).close()


def test_lossless_tier_restores_bit_exact_state():
    cache = make(HYBRID, MemoryTierConfig(capacity_bytes=8 << 20, codec="lossless", prefault=False))
    toks = tokens(48)
    fill(cache, toks, [3])
    assert_restored(cache.retrieve_states(toks), toks, 3)


def test_snapshots_are_promoted_like_chunks(tmp_path):
    fast = MemoryTierConfig(capacity_bytes=8 << 20, prefault=False)
    disk = DiskTierConfig(path=tmp_path, capacity_bytes=32 << 20, fsync=False, write=WriteMode.THROUGH,
                          admission="always")
    toks = tokens(64)
    with make(HYBRID, fast, disk) as first:
        fill(first, toks, [4])
        first.tiers[1].flush()
    with make(HYBRID, fast, disk) as restarted:  # an empty memory tier: everything comes from disk
        assert restarted.lookup(toks) == 64
        assert_restored(restarted.retrieve_states(toks), toks, 4)
        assert restarted.metrics.get("kvtier_state_snapshots_loaded_total", tier="disk", kind="ssm") == 1
        assert restarted.tiers[0].contains([state_key(restarted.keys(toks)[3], k) for k in (StateKind.CONV,
                                                                                          StateKind.SSM)]) == [True] * 2


def test_snapshot_stores_and_promotions_are_reported_as_snapshots_apart_from_chunks():
    """The event rule of kvtier.core.events: snapshots enter tiers as EntryKind.SNAPSHOT, promotions included."""
    memory = MemoryTierConfig(capacity_bytes=8 << 20, prefault=False)
    toks = tokens(64)
    with make(HYBRID, memory, memory) as cache:
        seen = []
        cache.events.subscribe(seen.extend)
        fill(cache, toks, [4])
        wanted = sorted(state_key(cache.keys(toks)[3], kind) for kind in (StateKind.CONV, StateKind.SSM))
        assert sorted((e.tier, e.key) for e in seen if e.entry is EntryKind.SNAPSHOT) == [
            (tier, key) for tier in ("memory", "memory2") for key in wanted]
        assert {e.entry for e in seen if e.key not in wanted} == {EntryKind.CHUNK}
        cache.tiers[0].delete(wanted)
        seen.clear()
        assert_restored(cache.retrieve_states(toks), toks, 4)
        assert sorted((e.kind, e.tier, e.key, e.entry, e.position) for e in seen) == [
            (ChunkEventKind.STORED, "memory", key, EntryKind.SNAPSHOT, None) for key in wanted]


def test_snapshots_are_demoted_to_a_write_back_tier():
    snapshot_bytes = CONV.nbytes + SSM.nbytes
    fast = MemoryTierConfig(capacity_bytes=snapshot_bytes + (8 << 10), prefault=False)  # about one snapshot
    slow = MemoryTierConfig(capacity_bytes=8 << 20, prefault=False, write=WriteMode.BACK)
    cache = make(HYBRID, fast, slow)
    toks = tokens(64)
    fill(cache, toks, [2, 4])  # the fast tier cannot hold both snapshots: the first is evicted downwards
    assert cache.metrics.total("kvtier_demotions_total") > 0
    assert cache.lookup(toks) == 64
    assert_restored(cache.retrieve_states(toks), toks, 4)
    assert_restored(cache.retrieve_states(toks, max_tokens=63), toks, 2)


def test_store_states_checks_its_input():
    cache = make()
    toks = tokens(40)
    with pytest.raises(ConfigError):
        cache.store_states(toks, {3: snapshot(3)})  # only 2 full chunks
    with pytest.raises(ConfigError):
        cache.store_states(toks, {2: {StateKind.CONV: snapshot(2)[StateKind.CONV]}})  # a kind missing
    with pytest.raises(ConfigError):
        cache.store_states(toks, {2: {**snapshot(2), StateKind.SSM: torch.zeros(3, 4, 8, 8, dtype=torch.bfloat16)}})
    with pytest.raises(ConfigError):
        make(KV).store_states(toks, {1: snapshot(1)})


def test_restore_under_inference_mode_across_pipeline_windows():
    """Engines retrieve inside torch.inference_mode; the pipeline's workers write the KV on other threads."""
    cache = make(tuning=PipelineTuning(window_bytes=1))  # one chunk per window: several windows, a pool
    toks = tokens(100)
    fill(cache, toks, [6])
    with torch.inference_mode():
        prefix = cache.retrieve_states(toks)
    assert_restored(prefix, toks, 6)
    cache.close()
