"""Cache control on a real Mooncake pool (kvtier/tiers/mooncake/control.py): clears by model and of everything
through remove_by_regex; pins, expiry and tenants refused by name, as the store cannot do them."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.base.errors import NotSupported
from tests.tiers.mooncake.helpers import make_cache, prompt


def test_clear_one_model_leaves_the_others_and_all_clears_everything(mooncake_master):
    tokens, kv = prompt(3)
    with make_cache(mooncake_master) as a, make_cache(mooncake_master, model="other@1", segment_bytes=0) as b:
        assert a.store(tokens, kv) == b.store(tokens, kv) == len(tokens)
        assert a.control.lookup_tiers(tokens) == {"mooncake": len(tokens)}
        assert a.control.clear() == {"mooncake": 3}
        assert a.lookup(tokens) == 0 and b.lookup(tokens) == len(tokens)
        a.store(tokens, kv)
        assert a.control.clear(all=True) == {"mooncake": 6}
        assert b.lookup(tokens) == 0 and mooncake_master.keys() == []


def test_pins_ttl_and_tenants_are_refused_where_mooncake_cannot_do_them(mooncake_master):
    tokens, kv = prompt(2)
    with make_cache(mooncake_master) as cache:
        cache.store(tokens, kv, salt=b"alice")
        with pytest.raises(NotSupported, match="tier mooncake cannot pin"):
            cache.control.pin(tokens, salt=b"alice", tiers=["mooncake"])
        assert cache.control.pin(tokens, salt=b"alice") == {}  # no tier can pin: nothing to do
        assert cache.control.clear(tenant=b"alice") == {"mooncake": None}
        assert cache.lookup(tokens, salt=b"alice") == len(tokens)  # nothing changed
        other, other_kv = prompt(2, seed=1)
        assert cache.store(other, other_kv, ttl_s=30) == 0  # not kept past its retention: not stored at all
        assert cache.control.clear() == {"mooncake": 2}


def test_a_store_whose_expiry_is_optional_is_kept_until_the_pool_evicts_it(mooncake_master):
    """A P/D prompt's tail asks for an expiry only to reclaim space (ttl_required=False): the pool, which cannot
    expire entries, stores it anyway and serves it, where a store that requires its expiry is skipped."""
    from kvtier.core.cache import TensorSource

    tokens, kv = prompt(2, seed=2)
    with make_cache(mooncake_master) as cache:
        keys = cache.keys(tokens)
        ids = np.asarray(tokens, dtype=np.uint32)
        assert cache.store_keyed(keys, ids, TensorSource(kv), ttl_s=30) == [False, False]
        assert cache.store_keyed(keys, ids, TensorSource(kv), ttl_s=30, ttl_required=False) == [True, True]
        out, n = cache.retrieve(tokens)
        assert n == len(tokens) and out.equal(kv)
        assert cache.control.clear() == {"mooncake": 2}
