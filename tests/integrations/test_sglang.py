"""kvtier as SGLang's HiCache storage backend, driven through SGLang 0.5.23's own classes on the CPU.

The backend is built by SGLang's ``dynamic`` loader (``StorageBackendFactory``) from a
``HiCacheStorageConfig``, page keys are SGLang's ``get_hash_str`` chains, hybrid transfers SGLang's
``PoolTransfer``. The host pool is allocated in SGLang's documented layout by ``sglang_pool.HostPool``:
SGLang's own host pool classes do not import without a CUDA-built torchvision (see that module).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="scripts/setup.sh test installs sglang")

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402

from kvtier.base.errors import ConfigError  # noqa: E402
from kvtier.codecs import get_codec  # noqa: E402
from kvtier.codecs.blob import encode_blob  # noqa: E402
from kvtier.integrations.sglang.backend import KVTierStorage  # noqa: E402
from kvtier.integrations.sglang.pages import key_token_ids  # noqa: E402
from harness.sglang_pool import HostPool, MambaHostPool, backend, page_keys  # noqa: E402

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
MEMORY = {"tiers": [{"kind": "memory", "capacity_bytes": "8MiB"}]}


def disk(path: Path, **extra) -> dict:
    return {"tiers": [{"kind": "disk", "path": str(path), "capacity_bytes": "32MiB", "fsync": False,
                       "o_direct": False, **extra}]}


def tokens(n_pages: int, page_size: int = 4, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n_pages * page_size)]


def pages_of(pool: HostPool, first_page: int, n: int) -> list[torch.Tensor]:
    return [pool.raw_page((first_page + i) * pool.page_size) for i in range(n)]


def flush(store: KVTierStorage) -> None:
    for tier in store.cache.tiers:
        getattr(tier, "flush", lambda: None)()


def test_dynamic_loader_builds_the_backend():
    pool = HostPool("layer_first")
    store = backend(pool, MEMORY)
    assert isinstance(store, KVTierStorage)
    assert store.cache.chunk_size == pool.page_size  # one kvtier chunk per SGLang page
    assert store.batch_exists(page_keys(tokens(2), 4)) == 0
    store.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_into_other_host_pages(layout, mla):
    pool = HostPool(layout, mla=mla, head_dim=16 if mla else 8)
    pool.fill(1)
    keys = page_keys(tokens(4), 4)
    written = pages_of(pool, 2, 4)
    store = backend(pool, MEMORY)
    assert store.batch_set_v1(keys, pool.host_indices(2, 4)) == [True] * 4
    pool.kv_buffer.zero_()
    assert store.batch_exists(keys) == 4
    assert store.batch_get_v1(keys, pool.host_indices(9, 4)) == [True] * 4
    for got, want in zip(pages_of(pool, 9, 4), written):
        assert torch.equal(got, want)
    assert not pool.kv_buffer[..., :1].any() or torch.count_nonzero(pool.raw_page(0)) == 0  # page 0 untouched
    store.close()


def test_pages_read_across_layouts_through_a_shared_disk_tier(tmp_path):
    """Pages are stored canonical: a layer_first pool's pages load into page_first and page_first_direct pools."""
    keys = page_keys(tokens(3), 4)
    src = HostPool("layer_first")
    src.fill(2)
    writer = backend(src, disk(tmp_path))
    assert all(writer.batch_set_v1(keys, src.host_indices(0, 3)))
    writer.close()
    for layout in ("page_first", "page_first_direct"):
        dst = HostPool(layout)
        reader = backend(dst, disk(tmp_path))
        assert reader.batch_get_v1(keys, dst.host_indices(5, 3)) == [True] * 3
        for i in range(3):
            assert torch.equal(dst.geometry.page(dst.kv_buffer, (5 + i) * 4), src.geometry.page(src.kv_buffer, i * 4))
        reader.close()


def test_partial_hit_is_the_leading_run():
    pool = HostPool("page_first")
    pool.fill(3)
    keys = page_keys(tokens(6), 4)
    store = backend(pool, MEMORY)
    assert all(store.batch_set_v1(keys[:4], pool.host_indices(0, 4)))
    assert store.batch_exists(keys) == 4
    assert store.batch_exists(keys[1:]) == 3
    assert store.batch_get_v1(keys, pool.host_indices(8, 6)) == [True] * 4 + [False] * 2
    store.close()


def _foreign_blob(store: KVTierStorage, tier, page: torch.Tensor):
    """A well-formed blob sealed for another key: what a buggy or hostile writer could leave in a shared tier."""
    other = store.kvtier_keys(["not-this-page"])[0]
    return encode_blob(other, key_token_ids([other], store.geometry.page_size), tier.codec, page, seal=tier.verifies)


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_foreign_page_is_a_miss_with_every_later_page(tmp_path, where):
    pool = HostPool("layer_first")
    pool.fill(4)
    keys = page_keys(tokens(5), 4)
    store = backend(pool, MEMORY if where == "memory" else disk(tmp_path))
    assert all(store.batch_set_v1(keys, pool.host_indices(0, 5)))
    tier = store.cache.tiers[0]
    bad = store.kvtier_keys(keys[2:3])
    tier.delete(bad)
    flush(store)
    assert tier.put([(bad[0], _foreign_blob(store, tier, store.geometry.page(pool.kv_buffer, 0)))]) == [True]
    flush(store)
    want = pages_of(pool, 0, 2)
    assert store.batch_exists(keys) == 5  # present: only a read can tell it is not this page
    assert store.batch_get_v1(keys, pool.host_indices(10, 5)) == [True, True, False, False, False]
    assert all(torch.equal(g, w) for g, w in zip(pages_of(pool, 10, 2), want))
    assert store.batch_exists(keys) == 2  # the failing page was dropped from its tier
    store.close()


def test_corrupted_disk_bytes_and_truncation_are_misses(tmp_path):
    pool = HostPool("page_first_direct")
    pool.fill(5)
    keys = page_keys(tokens(4), 4)
    store = backend(pool, disk(tmp_path))
    assert all(store.batch_set_v1(keys, pool.host_indices(0, 4)))
    flush(store)
    ids = store.kvtier_keys(keys)
    # a chunk file is named by its key's hex, then its owner and expiry (kvtier/tiers/disk/names.py)
    files = {p.name.split(".")[0]: p for p in tmp_path.rglob("*") if p.is_file()}
    flipped, cut = files[ids[1].hex()], files[ids[3].hex()]
    data = bytearray(flipped.read_bytes())
    data[len(data) - 5] ^= 0x40
    flipped.write_bytes(bytes(data))
    os.truncate(cut, cut.stat().st_size // 2)
    assert store.batch_get_v1(keys, pool.host_indices(8, 4)) == [True, False, False, False]
    assert store.batch_get_v1(keys[2:], pool.host_indices(8, 2)) == [True, False]
    store.close()


def test_fuzzed_corruption_never_yields_a_wrong_page(tmp_path):
    """Random byte flips and truncations over every stored file: each page either loads bit-exact or is a miss."""
    gen = torch.Generator().manual_seed(11)
    pool = HostPool("layer_first", pages=24)
    pool.fill(6)
    keys = page_keys(tokens(8), 4)
    store = backend(pool, disk(tmp_path))
    want = pages_of(pool, 0, 8)
    ids = {k.hex() for k in store.kvtier_keys(keys)}
    for round_ in range(8):
        store.batch_set_v1(keys, pool.host_indices(0, 8))  # puts back what the last round's read dropped
        flush(store)
        files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.name.split(".")[0] in ids)
        assert len(files) == 8
        victim = files[int(torch.randint(len(files), (1,), generator=gen))]
        data = bytearray(victim.read_bytes())
        if round_ % 3 == 2:
            victim.write_bytes(bytes(data[: int(torch.randint(len(data), (1,), generator=gen))]))
        else:
            at = int(torch.randint(len(data), (1,), generator=gen))
            data[at] ^= 1 << int(torch.randint(8, (1,), generator=gen))
            victim.write_bytes(bytes(data))
        pool.kv_buffer[:, :, 8 * 4 :].zero_()
        ok = store.batch_get_v1(keys, pool.host_indices(8, 8))
        n = ok.index(False) if False in ok else len(ok)
        assert ok == [True] * n + [False] * (len(ok) - n)
        assert all(torch.equal(g, w) for g, w in zip(pages_of(pool, 8, n), want))
        assert n < 8  # every flip lands in a header, token ids, checksum or payload: all are checked
    store.close()


@pytest.mark.parametrize("other", [{"tp_rank": 1}, {"model": "org/model-b"}, {"tenant": "acme"}],
                         ids=["tp-rank", "model", "tenant"])
def test_namespaces_apart_in_a_shared_tier(tmp_path, other):
    keys = page_keys(tokens(2), 4)
    pool = HostPool("layer_first")
    pool.fill(7)
    writer = backend(pool, disk(tmp_path), tp_size=2)
    assert all(writer.batch_set_v1(keys, pool.host_indices(0, 2)))
    writer.close()
    extra = disk(tmp_path) | ({"tenant": other["tenant"]} if "tenant" in other else {})
    config = {k: v for k, v in other.items() if k != "tenant"}
    reader = backend(HostPool("layer_first"), extra, tp_size=2, **config)
    assert reader.batch_exists(keys) == 0
    reader.close()
    same = backend(HostPool("layer_first"), disk(tmp_path), tp_size=2)
    assert same.batch_exists(keys) == 2  # the same namespace does see them
    same.close()


def test_mla_pages_are_shared_by_every_rank(tmp_path):
    keys = page_keys(tokens(2), 4)
    pool = HostPool("page_first", mla=True, head_dim=16)
    pool.fill(8)
    writer = backend(pool, disk(tmp_path), tp_size=4, tp_rank=0)
    assert all(writer.batch_set_v1(keys, pool.host_indices(0, 2)))
    writer.close()
    dst = HostPool("page_first", mla=True, head_dim=16)
    reader = backend(dst, disk(tmp_path), tp_size=4, tp_rank=3)
    assert reader.batch_get_v1(keys, dst.host_indices(0, 2)) == [True, True]
    assert torch.equal(dst.kv_buffer[:8], pool.kv_buffer[:8])
    reader.close()


def test_memory_tier_in_front_of_disk_promotes_hits(tmp_path):
    chain = {"tiers": [MEMORY["tiers"][0], disk(tmp_path, admission="always")["tiers"][0]]}
    keys = page_keys(tokens(3), 4)
    pool = HostPool("layer_first")
    pool.fill(9)
    first = backend(pool, chain)
    assert all(first.batch_set_v1(keys, pool.host_indices(0, 3)))
    first.close()  # its memory tier is gone; the disk tier keeps the pages
    dst = HostPool("layer_first")
    second = backend(dst, chain)
    assert second.cache.locate(second.kvtier_keys(keys)) == [1, 1, 1]
    assert second.batch_get_v1(keys, dst.host_indices(0, 3)) == [True] * 3
    assert torch.equal(dst.kv_buffer[:, :, :12], pool.kv_buffer[:, :, :12])
    assert second.cache.locate(second.kvtier_keys(keys)) == [0, 0, 0]  # promoted into memory
    second.close()


def test_older_interface_round_trips_flat_pages():
    pool = HostPool("page_first")
    pool.fill(10)
    keys = page_keys(tokens(2), 4)
    store = backend(pool, MEMORY)
    assert store.batch_set(keys, [pool.get_data_page(i * 4) for i in range(2)])
    assert store.exists(keys[0]) and not store.exists("absent")
    target = torch.zeros(pool.geometry.buffer_shape(4), dtype=pool.dtype).flatten()
    assert store.get(keys[1], target) is target
    assert torch.equal(target, pool.get_data_page(4))
    got = store.batch_get([keys[0], "absent", keys[1]], [torch.zeros_like(target) for _ in range(3)])
    assert torch.equal(got[0], pool.get_data_page(0)) and got[1] is None and got[2] is None
    assert store.set("single", pool.get_data_page(8)) and store.exists("single")
    store.close()


def test_v2_moves_kv_and_reports_other_pools_as_misses():
    pool = HostPool("layer_first")
    pool.fill(12)
    keys = page_keys(tokens(3), 4)
    store = backend(pool, MEMORY)
    store.register_mem_host_pool_v2(pool, PoolName.KV)
    kv = PoolTransfer(name=PoolName.KV, host_indices=pool.host_indices(0, 3), keys=keys)
    assert store.batch_set_v2([kv]) == {PoolName.KV: [True] * 3}
    result = store.batch_exists_v2(keys)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [1, 2, 3])
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert store.batch_exists_v2(keys, [mamba]).kv_hit_pages == 0
    back = PoolTransfer(name=PoolName.KV, host_indices=pool.host_indices(5, 3), keys=keys)
    assert store.batch_get_v2([back, mamba]) == {PoolName.KV: [True] * 3, PoolName.MAMBA: [False]}
    assert torch.equal(pool.kv_buffer[:, :, 20:32], pool.kv_buffer[:, :, :12])
    store.close()


def hybrid(tmp_path=None, *, memory: bool = True):
    """A hybrid model's backend: its KV pool and a Mamba state pool, registered as SGLang registers them."""
    pool, mamba = HostPool("layer_first"), MambaHostPool(slots=8)
    pool.fill(14)
    tiers = [{"kind": "memory", "capacity_bytes": "8MiB"}] if memory else []
    if tmp_path is not None:
        tiers.append({"kind": "disk", "path": str(tmp_path), "capacity_bytes": "8MiB", "fsync": False,
                      "admission": "always"})
    store = backend(pool, {"tiers": tiers})
    store.register_mem_host_pool_v2(pool, PoolName.KV)
    store.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    store.on_host_pools_registered()
    return pool, mamba, store


def test_v2_stores_a_hybrid_models_mamba_state_beside_its_kv(tmp_path):
    pool, mamba, store = hybrid(tmp_path)
    keys = page_keys(tokens(4), 4)
    kv = PoolTransfer(name=PoolName.KV, host_indices=pool.host_indices(0, 4), keys=keys)
    # SGLang offloads the state of a node's last page only (TRAILING_PAGES): here after pages 2 and 4
    states = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1, 3]), keys=[keys[1], keys[3]],
                          hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert store.batch_set_v2([kv, states]) == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True, True]}
    for tier in store._side["mamba"].cache.tiers:
        getattr(tier, "flush", lambda: None)()
    probe = PoolTransfer(name=PoolName.MAMBA, keys=[keys[3]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    result = store.batch_exists_v2(keys, [probe])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [2, 4])  # where a state sits
    assert result.extra_pool_hit_pages[PoolName.MAMBA] == 4
    want = [mamba.get_data_page(i).clone() for i in (1, 3)]
    fresh = MambaHostPool(slots=8, seed=99)
    store.register_mem_host_pool_v2(fresh, PoolName.MAMBA)  # a restarted server's empty state pool
    back = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([6, 7]), keys=[keys[1], keys[3]])
    assert store.batch_get_v2([back]) == {PoolName.MAMBA: [True, True]}
    assert torch.equal(fresh.get_data_page(6), want[0]) and torch.equal(fresh.get_data_page(7), want[1])
    store.close()


def test_v2_hit_policies_cut_the_prefix_to_where_every_pool_allows():
    pool, mamba, store = hybrid()
    keys = page_keys(tokens(4), 4)
    store.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=pool.host_indices(0, 4), keys=keys),
                        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0, 1]), keys=keys[:2])])
    trailing = PoolTransfer(name=PoolName.MAMBA, keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert store.batch_exists_v2(keys, [trailing]).restorable_prefix_pages == [1, 2]  # pages 1-2 hold a state
    every = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert store.batch_exists_v2(keys, [every]).kv_hit_pages == 2
    groups = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    assert store.batch_exists_v2(keys, [groups]).kv_hit_pages == 0  # unsupported: nothing restorable
    unknown = PoolTransfer(name=PoolName.SWA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert store.batch_exists_v2(keys, [unknown]).kv_hit_pages == 0  # a pool never registered
    store.close()


def test_a_corrupt_state_page_is_a_miss_and_its_prefix_is_not_restorable(tmp_path):
    pool, mamba, store = hybrid(tmp_path, memory=False)
    keys = page_keys(tokens(2), 4)
    store.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=pool.host_indices(0, 2), keys=keys),
                        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=keys[1:])])
    side = store._side["mamba"]
    for tier in side.cache.tiers:
        tier.flush()
    (key,) = side.keys(keys[1:])
    (state_file,) = [p for p in (tmp_path / "pool-mamba").rglob("*")
                     if p.is_file() and p.name.split(".")[0] == key.hex()]
    data = bytearray(state_file.read_bytes())
    data[len(data) - 3] ^= 0x01  # one bit of the state page's payload
    state_file.write_bytes(bytes(data))
    before = mamba.get_data_page(5).clone()
    got = store.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys[1:])])
    assert got == {PoolName.MAMBA: [False]} and torch.equal(mamba.get_data_page(5), before)
    probe = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert store.batch_exists_v2(keys, [probe]).kv_hit_pages == 0  # the bad page was dropped
    store.close()


def test_clear_forgets_this_servers_pages_side_pools_included(tmp_path):
    pool, mamba, store = hybrid(tmp_path)
    keys = page_keys(tokens(3), 4)
    store.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=pool.host_indices(0, 3), keys=keys),
                        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=keys[2:])])
    for cache in (store.cache, store._side["mamba"].cache):
        cache.tiers[-1].flush()
    assert store.batch_exists(keys) == 3 and store._side["mamba"].held(keys[2:]) == [True]
    assert store.clear() is True
    assert store.batch_exists(keys) == 0 and store._side["mamba"].held(keys[2:]) == [False]
    assert all(store.batch_set_v1(keys, pool.host_indices(0, 3)))  # and it serves on
    store.close()


def test_nothing_raises_into_sglang():
    pool = HostPool("layer_first")
    keys = page_keys(tokens(2), 4)
    store = backend(pool, MEMORY)
    assert store.batch_set_v1(keys, torch.arange(2, 10)) == [False, False]  # not whole pages
    assert store.batch_set_v1(keys, pool.host_indices(0, 1)) == [False, False]  # too few slots
    assert store.batch_get_v1(keys, pool.host_indices(1000, 2)) == [False, False]  # outside the pool
    assert store.batch_set(keys, [torch.zeros(3)] * 2) is False  # a flat page of the wrong size
    store.close()
    unattached = KVTierStorage(backend.__globals__["storage_config"](MEMORY))
    assert unattached.batch_exists(keys) == 0 and unattached.batch_get_v1(keys, pool.host_indices(0, 2)) == [False] * 2


def test_configuration_errors_fail_at_start():
    with pytest.raises(ConfigError):
        backend(HostPool("layer_first"), {"tiers": [{"kind": "memory", "no_such_option": 1}]})
    with pytest.raises(ConfigError):
        backend(HostPool("layer_first"), {"chunk_size": 16, **MEMORY})  # not SGLang's page size
    bad_layout = HostPool("layer_first")
    bad_layout.layout = "page_head"
    with pytest.raises(ConfigError):
        backend(bad_layout, MEMORY)


def test_codec_tier_round_trips_within_its_error():
    pool = HostPool("layer_first", dtype=torch.float16)
    pool.fill(13)
    keys = page_keys(tokens(2), 4)
    store = backend(pool, {"tiers": [{"kind": "memory", "capacity_bytes": "8MiB", "codec": "lossless"}]})
    assert get_codec("lossless")
    assert all(store.batch_set_v1(keys, pool.host_indices(0, 2)))
    assert store.batch_get_v1(keys, pool.host_indices(4, 2)) == [True, True]
    assert torch.equal(pool.kv_buffer[:, :, 16:24], pool.kv_buffer[:, :, :8])
    store.close()
