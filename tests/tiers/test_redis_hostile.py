"""Split-value heads planted in a shared Redis (issue 17), read through a real KVCache and redis-server.

A head declares its value's size, part size and part count; the reader used to believe it and build one
GET per declared part before anything checked the deadline: a 33-byte head declaring 4 MiB in 1-byte
parts cost 35 s and 2.6 GB per retrieve, and was never deleted, so it did so again every time.
"""

from __future__ import annotations

import struct

import pytest
import torch

from kvtier.codecs import BytesPayload
from kvtier.tiers import RedisTier, RedisTierConfig
from kvtier.tiers.redis.split import MAX_PARTS, MIN_PART_BYTES, SplitHeader
from tests.conformance.tier_suite import key, tier_context
from tests.tiers.test_redis import CHUNK, make_cache, prompt, redis_key


def head_declaring(total: int, part_len: int, n_parts: int | None = None) -> bytes:
    n = -(-total // part_len) if n_parts is None else n_parts
    return struct.pack("<4sHH8sQII", b"KVTS", 1, 0, b"\x01" * 8, total, part_len, n) + b"\0" * part_len


def commands(server, name: str) -> int:
    """How many ``name`` commands the server has run (INFO commandstats)."""
    for line in server.cli("INFO", "commandstats").splitlines():
        if line.startswith(f"cmdstat_{name}:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("declared", [
    pytest.param((4 << 20, 1), id="4MiB-in-1-byte-parts"),  # the head from the report, 33 bytes
    pytest.param((1 << 30, 4096), id="1GiB-in-4KiB-parts"),  # 262,144 parts of a legal size
    pytest.param((MAX_PARTS * MIN_PART_BYTES + 1, MIN_PART_BYTES), id="one-part-over-the-cap"),
])
def test_a_planted_head_is_refused_before_any_part_is_asked_for_and_deleted(redis_server, declared):
    redis_server.flush()
    tokens, kv = prompt(3)
    with make_cache(redis_server.url, timeout_s=0.5) as cache:
        cache.store(tokens, kv)
        head = redis_key(cache, tokens, 1)
        redis_server.cli("DEL", head)
        redis_server.set_bytes(head, head_declaring(*declared))
        gets = commands(redis_server, "get")
        out, n = cache.retrieve(tokens)
        assert n == CHUNK and torch.equal(out[:, :, :CHUNK], kv[:, :, :CHUNK])  # a miss from the bad head on
        assert commands(redis_server, "get") - gets == 3  # one per head, in one pipeline: no part asked for
        assert cache.metrics.total("kvtier_corrupt_chunks_total") == 1
        assert redis_server.cli("EXISTS", head) == "0"  # deleted, so the next retrieve does not pay again
        cache.store(tokens, kv)
        assert cache.retrieve(tokens)[1] == len(tokens)


def test_the_bounds_admit_every_value_a_writer_makes_and_nothing_beyond():
    assert SplitHeader.parse(SplitHeader.new(MAX_PARTS * MIN_PART_BYTES, MIN_PART_BYTES).pack()) is not None
    assert SplitHeader.parse(SplitHeader(b"n" * 8, 10_000, MIN_PART_BYTES - 1).pack()) is None
    assert SplitHeader.parse(SplitHeader(b"n" * 8, MAX_PARTS * MIN_PART_BYTES + 1, MIN_PART_BYTES).pack()) is None


def test_a_value_needing_more_parts_than_readers_accept_is_not_written(redis_server):
    redis_server.flush()
    tier = RedisTier(RedisTierConfig(url=redis_server.url, max_part_bytes=MIN_PART_BYTES), tier_context("redis"))
    try:
        largest = MAX_PARTS * MIN_PART_BYTES
        assert tier.put([(key(1), BytesPayload(b"v" * largest)), (key(2), BytesPayload(b"v" * (largest + 1)))]) \
            == [True, False]
        assert tier._metrics.get("kvtier_skipped_stores_total", tier="redis", reason="too_large") == 1
        with tier.get([key(1), key(2)]) as (whole, missing):
            assert whole is not None and bytes(whole) == b"v" * largest and missing is None
    finally:
        tier.close()


def test_a_head_at_the_bounds_costs_at_most_its_parts_and_is_deleted_when_they_are_missing(redis_server):
    redis_server.flush()
    tokens, kv = prompt(2)
    with make_cache(redis_server.url, timeout_s=0.5) as cache:
        cache.store(tokens, kv)
        head = redis_key(cache, tokens, 1)
        redis_server.set_bytes(head, head_declaring(MAX_PARTS * MIN_PART_BYTES, MIN_PART_BYTES))
        gets = commands(redis_server, "get")
        assert cache.retrieve(tokens)[1] == CHUNK
        assert commands(redis_server, "get") - gets == 2 + MAX_PARTS - 1  # the heads, then each declared part
        assert cache.metrics.total("kvtier_incomplete_values_total") == 1
        assert redis_server.cli("EXISTS", head) == "0"
