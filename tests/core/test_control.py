"""cache.control and store(ttl_s=) through a real KVCache over real memory and disk tiers (issue 30)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.errors import InvalidArgument, NotSupported, PinBudgetExceeded
from kvtier.policy import POLICIES
from kvtier.tiers import DiskTierConfig, MemoryTierConfig
from kvtier.tiers.control import MAX_TTL_S
from tests.conformance.tier_suite import FakeClock

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 16
CHUNK_BYTES = SPEC.bytes_per_token * CHUNK + 320  # payload plus a generous header
ALICE, BOB = b"alice-salt", b"bob-salt"


def kv_for(n_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(SPEC.chunk_shape(n_tokens), generator=torch.Generator().manual_seed(seed)).to(SPEC.dtype)


def prompt(i: int, n_chunks: int = 2) -> list[int]:
    return [i * 1000 + j for j in range(n_chunks * CHUNK)]


def memory(chunks: int = 16, **options) -> MemoryTierConfig:
    return MemoryTierConfig(capacity_bytes=chunks * CHUNK_BYTES, prefault=False, **options)


def make_cache(*tiers, clock=None, tenants=None) -> KVCache:
    config = CacheConfig(chunk_size=CHUNK, tiers=tiers or (memory(),), tenants=tenants or {})
    return KVCache(SPEC, "control-model@1", config, clock=clock or FakeClock())


def store(cache: KVCache, i: int, **kwargs) -> int:
    return cache.store(prompt(i), kv_for(2 * CHUNK, i), **kwargs)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_pinned_prefix_survives_a_flood_that_evicts_everything_else(policy, tmp_path):
    tiers = (memory(8, policy=policy), DiskTierConfig(path=tmp_path, admission="always",
                                                      capacity_bytes=12 * CHUNK_BYTES, fsync=False, policy=policy))
    with make_cache(*tiers) as cache:
        store(cache, 0)
        cache.tiers[1].flush()
        assert cache.control.pin(prompt(0)) == {"memory": 2 * CHUNK, "disk": 2 * CHUNK}
        for i in range(1, 40):
            store(cache, i)
            cache.retrieve(prompt(i))
        cache.tiers[1].flush()
        assert cache.control.lookup_tiers(prompt(0)) == {"memory": 2 * CHUNK, "disk": 2 * CHUNK}
        assert cache.control.lookup_tiers(prompt(1)) == {"memory": 0, "disk": 0}
        out, n = cache.retrieve(prompt(0))
        assert n == 2 * CHUNK and torch.equal(out, kv_for(2 * CHUNK, 0))
        assert cache.control.unpin(prompt(0))["memory"] > 0
        assert {name: u.pinned_bytes for name, u in cache.control.stats().items()} == {"memory": 0, "disk": 0}


def test_pins_survive_a_restart_of_the_disk_tier(tmp_path):
    tiers = (memory(4), DiskTierConfig(path=tmp_path, admission="always", capacity_bytes=8 * CHUNK_BYTES, fsync=False))
    with make_cache(*tiers) as cache:
        store(cache, 0, salt=ALICE)
        cache.tiers[1].flush()
        cache.control.pin(prompt(0), salt=ALICE, tiers=["disk"])
    with make_cache(*tiers) as cache:
        assert cache.control.stats()["disk"].pinned_bytes > 0
        for i in range(1, 30):
            store(cache, i)
        cache.tiers[1].flush()
        assert cache.lookup(prompt(0), salt=ALICE) == 2 * CHUNK
        assert cache.control.lookup_tiers(prompt(0), salt=ALICE) == {"memory": 0, "disk": 2 * CHUNK}
        assert cache.control.clear(tenant=ALICE)["disk"] == 2  # its owner came back with it


def test_a_ttl_expires_entries_in_every_tier_and_they_are_reclaimed(tmp_path):
    clock = FakeClock()
    tiers = (memory(), DiskTierConfig(path=tmp_path, admission="always", capacity_bytes=16 * CHUNK_BYTES, fsync=False))
    with make_cache(*tiers, clock=clock) as cache:
        assert store(cache, 0, ttl_s=5) == 2 * CHUNK
        store(cache, 1)
        cache.tiers[1].flush()
        assert cache.lookup(prompt(0)) == 2 * CHUNK
        clock.now += 5.5
        assert cache.lookup(prompt(0)) == 0 and cache.retrieve(prompt(0))[1] == 0
        assert cache.lookup(prompt(1)) == 2 * CHUNK
        assert {name: usage.entries for name, usage in cache.control.stats().items()} == {"memory": 2, "disk": 2}
        assert store(cache, 0, ttl_s=0.5) == 2 * CHUNK  # stored again once it expired


def test_a_ttl_survives_a_restart_of_the_disk_tier(tmp_path):
    clock = FakeClock()
    tiers = (DiskTierConfig(path=tmp_path, admission="always", capacity_bytes=16 * CHUNK_BYTES, fsync=False),)
    with make_cache(*tiers, clock=clock) as cache:
        store(cache, 0, ttl_s=60)
    with make_cache(*tiers, clock=clock) as cache:
        assert cache.lookup(prompt(0)) == 2 * CHUNK
        clock.now += 61
        assert cache.lookup(prompt(0)) == 0


@pytest.mark.parametrize("ttl", [-1, math.nan, math.inf, "10", True, 1e306, MAX_TTL_S + 1])
def test_a_bad_ttl_is_a_clear_error_and_stores_nothing(ttl):
    with make_cache() as cache:
        with pytest.raises(InvalidArgument, match="ttl_s"):
            store(cache, 0, ttl_s=ttl)
        assert cache.lookup(prompt(0)) == 0 and cache.control.stats()["memory"].entries == 0


def test_one_tenants_flood_does_not_evict_another_beyond_its_share():
    tenants = {"alice": ALICE.hex(), "bob": BOB.hex()}
    with make_cache(memory(16, tenant_share=0.5, tenant_shares={"bob": 0.25}), tenants=tenants) as cache:
        store(cache, 0, salt=BOB)
        store(cache, 1, salt=BOB)
        for i in range(10, 60):
            store(cache, i, salt=ALICE)
        assert cache.lookup(prompt(0), salt=BOB) == cache.lookup(prompt(1), salt=BOB) == 2 * CHUNK
        usage = cache.control.stats()["memory"]
        assert 0 < usage.tenant_bytes["alice"] <= usage.capacity_bytes // 2
        for i in range(60, 70):  # bob's own flood stays within its quarter: it evicts its own entries
            store(cache, i, salt=BOB)
        assert cache.control.stats()["memory"].tenant_bytes["bob"] <= usage.capacity_bytes // 4
        assert cache.lookup(prompt(59), salt=ALICE) == 2 * CHUNK


def test_clear_by_tenant_leaves_the_others_and_all_clears_everything(tmp_path, caplog):
    tiers = (memory(), DiskTierConfig(path=tmp_path, admission="always", capacity_bytes=16 * CHUNK_BYTES, fsync=False))
    with make_cache(*tiers) as cache:
        store(cache, 0, salt=ALICE)
        store(cache, 1, salt=BOB)
        store(cache, 2)
        cache.tiers[1].flush()
        with caplog.at_level(logging.INFO, logger="kvtier.core.control"):
            assert cache.control.clear(tenant=ALICE) == {"memory": 2, "disk": 2}
        assert "clear tenant" in caplog.text
        cache.tiers[1].flush()
        assert cache.lookup(prompt(0), salt=ALICE) == 0
        assert cache.lookup(prompt(1), salt=BOB) == cache.lookup(prompt(2)) == 2 * CHUNK
        assert cache.control.clear(tenant=b"") == {"memory": 2, "disk": 2}  # the default tenant
        assert cache.lookup(prompt(1), salt=BOB) == 2 * CHUNK
        assert cache.control.clear(all=True) == {"memory": 2, "disk": 2}
        assert cache.lookup(prompt(1), salt=BOB) == 0
        with pytest.raises(InvalidArgument):
            cache.control.clear(tenant=ALICE, all=True)


def test_a_hit_promoted_from_disk_keeps_its_owner(tmp_path):
    tiers = (memory(4), DiskTierConfig(path=tmp_path, admission="always", capacity_bytes=32 * CHUNK_BYTES, fsync=False))
    with make_cache(*tiers) as cache:
        store(cache, 0, salt=ALICE)
        for i in range(1, 5):
            store(cache, i)  # pushes alice's chunks out of memory
        cache.tiers[1].flush()
        assert cache.control.lookup_tiers(prompt(0), salt=ALICE) == {"memory": 0, "disk": 2 * CHUNK}
        assert cache.retrieve(prompt(0), salt=ALICE)[1] == 2 * CHUNK  # promoted into memory
        assert cache.control.lookup_tiers(prompt(0), salt=ALICE)["memory"] == 2 * CHUNK
        assert cache.control.clear(tenant=ALICE)["memory"] == 2


def test_a_pin_past_the_budget_changes_nothing_in_any_tier(tmp_path):
    tiers = (memory(16, pin_budget_bytes=4 * CHUNK_BYTES),
             DiskTierConfig(path=tmp_path, admission="always", capacity_bytes=16 * CHUNK_BYTES, fsync=False,
                            pin_budget_bytes=CHUNK_BYTES))
    with make_cache(*tiers) as cache:
        store(cache, 0)
        cache.tiers[1].flush()
        with pytest.raises(PinBudgetExceeded, match="tier disk"):
            cache.control.pin(prompt(0))
        assert {name: u.pinned_bytes for name, u in cache.control.stats().items()} == {"memory": 0, "disk": 0}
        store(cache, 1)
        cache.control.pin(prompt(1), tiers=["memory"])
        with pytest.raises(PinBudgetExceeded):
            cache.control.pin(prompt(0))
        assert cache.control.stats()["memory"].pinned_bytes > 0  # the earlier pin stays
        assert cache.control.unpin(prompt(0))["memory"] == 0  # prompt 0 was never pinned


def test_bad_arguments_are_clear_errors():
    with make_cache() as cache:
        store(cache, 0)
        with pytest.raises(InvalidArgument, match="unknown tier"):
            cache.control.pin(prompt(0), tiers=["nvme"])
        with pytest.raises(InvalidArgument, match="list of tier names"):
            cache.control.pin(prompt(0), tiers="memory")
        with pytest.raises(InvalidArgument, match="salt"):
            cache.control.clear(tenant="alice")
        assert cache.control.stats()["memory"].pinned_bytes == 0
    with make_cache(memory(pin_budget_bytes=0)) as cache:
        store(cache, 0)
        with pytest.raises(PinBudgetExceeded):
            cache.control.pin(prompt(0))
    assert issubclass(NotSupported, InvalidArgument) and issubclass(PinBudgetExceeded, InvalidArgument)


def test_stats_name_configured_tenants_and_lump_the_rest():
    with make_cache(tenants={"alice": ALICE.hex()}) as cache:
        store(cache, 0, salt=ALICE)
        store(cache, 1, salt=BOB)
        store(cache, 2, salt=b"carol")
        store(cache, 3)
        usage = cache.control.stats()["memory"]
        assert set(usage.tenant_bytes) == {"alice", "other", "default"}
        assert usage.tenant_bytes["other"] == 2 * usage.tenant_bytes["alice"] == 2 * usage.tenant_bytes["default"]
        assert usage.entries == 8 and usage.pin_budget_bytes == usage.capacity_bytes // 4
        assert cache.control.features() == {"memory": ["clear", "pin", "tenants", "ttl"]}


def test_a_chunk_demoted_to_a_write_back_tier_keeps_its_owner_and_expiry(tmp_path):
    from kvtier.tiers import WriteMode

    clock = FakeClock()
    tiers = (memory(4), DiskTierConfig(path=tmp_path, admission="always", capacity_bytes=32 * CHUNK_BYTES, fsync=False,
                                       write=WriteMode.BACK))
    with make_cache(*tiers, clock=clock) as cache:
        store(cache, 0, salt=ALICE, ttl_s=60)
        store(cache, 1, salt=BOB)
        store(cache, 2, salt=BOB)  # evicts alice's chunks into the disk tier
        cache.tiers[1].flush()
        assert cache.control.lookup_tiers(prompt(0), salt=ALICE) == {"memory": 0, "disk": 2 * CHUNK}
        assert cache.tiers[1].tags_of(cache.keys(prompt(0), salt=ALICE))[0].tenant != ""
        clock.now += 61
        assert cache.lookup(prompt(0), salt=ALICE) == 0  # its expiry came along
        store(cache, 3)  # evicts bob's first prompt into the disk tier
        cache.tiers[1].flush()
        assert cache.control.clear(tenant=BOB) == {"memory": 2, "disk": 2}  # demoted, still bob's


@pytest.mark.parametrize("values, message", [
    ({"tenants": {"acme": "zz"}}, "not a salt in hex"),
    ({"tenants": {"other": "ab"}}, "other than default/other"),
    ({"tenants": {"acme": ""}}, "empty salt is the default tenant"),
    ({"tiers": [{"kind": "memory", "tenant_share": 1.5}]}, "fraction in"),
    ({"tiers": [{"kind": "disk", "path": "/tmp/x", "tenant_shares": {"acme": 0}}]}, "fraction in"),
    ({"tiers": [{"kind": "memory", "pin_budget_bytes": -1}]}, "must not be negative"),
])
def test_bad_control_config_is_a_config_error(values, message):
    from kvtier import ConfigError

    with pytest.raises(ConfigError, match=message):
        CacheConfig.from_dict(values)


def test_a_share_for_a_tenant_the_cache_does_not_name_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.ledger"):
        make_cache(memory(tenant_shares={"acme": 0.5})).close()
    assert "acme" in caplog.text


def test_a_tier_that_raises_an_untranslated_error_is_a_skipped_store_never_an_exception(monkeypatch):
    """T-1's class: the Redis tier once raised OverflowError out of a store. Whatever a tier raises, a store
    skips that tier (counted), the caller gets no exception, and the next store is written."""
    with make_cache() as cache:
        tier, put_tagged = cache.tiers[0], cache.tiers[0].put_tagged
        calls = []

        def overflows_once(items, tags):
            calls.append(1)
            if len(calls) == 1:
                raise OverflowError("injected: cannot convert float infinity to integer")
            return put_tagged(items, tags)

        monkeypatch.setattr(tier, "put_tagged", overflows_once)
        assert store(cache, 0, ttl_s=60) == 0 and cache.lookup(prompt(0)) == 0
        assert "kvtier_tier_errors_total" in cache.metrics.render_prometheus()
        assert store(cache, 1, ttl_s=60) == 2 * CHUNK and cache.lookup(prompt(1)) == 2 * CHUNK


def test_a_promotion_whose_put_raises_still_loads_and_the_next_promotes(tmp_path, monkeypatch):
    """The promotion of a disk hit into memory raising an untranslated error (injected): the load still returns
    every token, and the next load's promotion lands."""
    disk = DiskTierConfig(path=tmp_path, admission="always", capacity_bytes=16 * CHUNK_BYTES, fsync=False)
    with make_cache(memory(), disk) as cache:
        store(cache, 0)
        cache.tiers[1].flush()
        keys = cache.keys(prompt(0))
        cache.tiers[0].delete(keys)  # only on disk now: a load promotes
        tier, put, calls = cache.tiers[0], cache.tiers[0].put, []

        def raises_once(items):
            calls.append(1)
            if len(calls) == 1:
                raise KeyError("injected: a bug in one promotion")
            return put(items)

        monkeypatch.setattr(tier, "put", raises_once)  # the default tenant's entries: a plain put
        assert cache.retrieve(prompt(0))[1] == 2 * CHUNK and tier.contains(keys) == [False, False]
        assert cache.retrieve(prompt(0))[1] == 2 * CHUNK and tier.contains(keys) == [True, True]
