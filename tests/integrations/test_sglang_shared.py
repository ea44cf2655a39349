"""The SGLang HiCache backend over shared tiers: real redis-server / valkey-server processes and a real Mooncake
pool (mooncake_master plus a pool member holding the memory). Two backends stand for two SGLang servers: what
one stores, the other loads bit-exact; a foreign value under a page's key is a miss; tenants stay apart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="scripts/setup.sh test installs sglang")

from harness.sglang_pool import HostPool, backend, page_keys  # noqa: E402
from tests.integrations.test_sglang import _foreign_blob, tokens  # noqa: E402
from harness.mooncake_master import MooncakeMaster, SegmentHost  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402
from tests.tiers.conftest import SERVER_KINDS, _require_redis  # noqa: E402
from tests.tiers.mooncake.conftest import require_mooncake  # noqa: E402


@pytest.fixture(scope="module", params=SERVER_KINDS)
def redis_tier(request) -> Iterator[dict]:
    _require_redis(request.param)
    with RedisServer(kind=request.param) as server:
        yield {"kind": "redis", "url": server.url}


@pytest.fixture(scope="module")
def mooncake_tier() -> Iterator[dict]:
    require_mooncake()
    with MooncakeMaster() as master, SegmentHost(master, 64 << 20):
        yield {"kind": "mooncake", "master_address": master.master_address, "metadata_server": master.metadata_url,
               "metrics_url": master.metrics_url, "segment_bytes": 0, "buffer_bytes": "16MiB", "timeout_s": 5.0}


def _two_servers_share_pages(tier: dict, model: str) -> None:
    keys = page_keys(tokens(4, seed=len(model)), 4)
    src = HostPool("page_first", pages=8)
    src.fill(21)
    writer = backend(src, {"tiers": [tier]}, model=model)
    assert writer.batch_set_v1(keys, src.host_indices(0, 4)) == [True] * 4
    dst = HostPool("layer_first", pages=8)
    reader = backend(dst, {"tiers": [{"kind": "memory", "capacity_bytes": "4MiB"}, tier]}, model=model)
    assert reader.batch_exists(keys) == 4
    assert reader.batch_get_v1(keys, dst.host_indices(3, 4)) == [True] * 4
    for i in range(4):
        assert torch.equal(dst.geometry.page(dst.kv_buffer, (3 + i) * 4), src.geometry.page(src.kv_buffer, i * 4))
    stranger = backend(HostPool("layer_first"), {"tiers": [tier], "tenant": "other"}, model=model)
    assert stranger.batch_exists(keys) == 0
    shared = writer.cache.tiers[0]
    bad = writer.kvtier_keys(keys[1:2])
    shared.delete(bad)
    assert shared.put([(bad[0], _foreign_blob(writer, shared, src.geometry.page(src.kv_buffer, 0)))]) == [True]
    fresh = HostPool("layer_first", pages=8)
    third = backend(fresh, {"tiers": [tier]}, model=model)
    assert third.batch_get_v1(keys, fresh.host_indices(0, 4)) == [True, False, False, False]
    for store in (writer, reader, stranger, third):
        store.close()


def test_redis_and_valkey_share_pages_between_servers(redis_tier):
    _two_servers_share_pages(redis_tier, "org/redis-model")


def test_mooncake_pool_shares_pages_between_servers(mooncake_tier):
    _two_servers_share_pages(mooncake_tier, "org/mooncake-model")
