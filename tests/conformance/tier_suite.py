"""Conformance suite every Tier implementation passes.

Subclass ``TierConformance`` in a test module and implement ``make_tier``; pytest collects the inherited
tests. A tier that evicts by itself to stay under its capacity subclasses ``EvictingTierConformance`` instead;
one that reports evictions (to feed a write-back tier) also mixes in ``EvictionListenerConformance``, and one
that reports removals and lists its keys (for the cache's event stream) ``RemovalListenerConformance``. A shared
store whose server does the evicting (Redis with maxmemory) stays with the base class.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kvtier.base.keys import ChunkHash
from kvtier.base.layout import KVSpec
from kvtier.base.metrics import Metrics
from kvtier.codecs import BytesPayload, get_codec
from kvtier.codecs.blob import blob_bytes, encode_blob
from kvtier.tiers import Flushable, Tier, TierContext

TOKENS = 16
SHAPE = (2, 2, TOKENS, 2, 32)  # 4 KiB of float32 payload per chunk
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)  # the KV spec of SHAPE


def tier_context(name: str, clock: Callable[[], float] | None = None, **fields) -> TierContext:
    """What a KVCache hands the tiers it builds, for tests that build a tier themselves (``clock``: the clock
    entries expire by; ``fields``: other TierContext fields, e.g. ``tenants``)."""
    if clock is not None:
        fields["clock"] = clock
    return TierContext(SPEC, Metrics(), name, **fields)


class FakeClock:
    """An injectable clock (seconds) that moves only when a test moves it."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(i: int) -> ChunkHash:
    return ChunkHash(hashlib.sha256(f"conformance-{i}".encode()).digest())


def blob(i: int, *, seal: bool = True, shape: tuple[int, ...] = SHAPE) -> bytes:
    """A real blob for key(i), deterministic in i."""
    gen = torch.Generator().manual_seed(i)
    chunk = torch.randn(shape, generator=gen)
    tokens = np.arange(i, i + shape[2], dtype="<u4")
    return bytes(blob_bytes(encode_blob(key(i), tokens, get_codec("raw"), chunk, seal=seal)))


BLOB_BYTES = len(blob(0))


class TierConformance:
    #: ``stats().used_bytes`` moves only with the entries stored (a server's memory figure also moves with its
    #: allocator and connection buffers, so a tier reporting one sets this False; entries stay exact)
    exact_usage = True

    def make_tier(self, capacity_bytes: int) -> Tier:
        raise NotImplementedError

    def settle(self, tier: Tier) -> None:
        """Wait until writes accepted by ``put`` are visible (tiers that write in the background are Flushable)."""
        if isinstance(tier, Flushable):
            tier.flush()

    # -- fixtures ------------------------------------------------------------------------------------------
    @pytest.fixture
    def new_tier(self) -> Iterator[Callable[[int], Tier]]:
        made: list[Tier] = []

        def factory(capacity_bytes: int = 64 * BLOB_BYTES) -> Tier:
            tier = self.make_tier(capacity_bytes)
            made.append(tier)
            return tier

        yield factory
        for tier in made:
            tier.close()

    def _put(self, tier: Tier, ids: list[int]) -> list[bool]:
        result = tier.put([(key(i), BytesPayload(blob(i, seal=tier.verifies))) for i in ids])
        self.settle(tier)
        return result

    def _read(self, tier: Tier, ids: list[int]) -> list[bytes | None]:
        with tier.get([key(i) for i in ids]) as values:
            return [None if v is None else bytes(v) for v in values]

    # -- behaviour -----------------------------------------------------------------------------------------

    def test_round_trip_batched(self, new_tier):
        tier = new_tier()
        assert self._put(tier, [1, 2, 3]) == [True, True, True]
        assert self._read(tier, [1, 99, 3, 2]) == [
            blob(1, seal=tier.verifies), None, blob(3, seal=tier.verifies), blob(2, seal=tier.verifies)]
        assert tier.contains([key(1), key(99), key(2)]) == [True, False, True]

    def test_empty_batches(self, new_tier):
        tier = new_tier()
        assert tier.put([]) == []
        assert tier.contains([]) == []
        with tier.get([]) as values:
            assert values == []
        tier.delete([])

    def test_put_existing_key_keeps_one_entry(self, new_tier):
        tier = new_tier()
        self._put(tier, [5])
        before = tier.stats()
        assert self._put(tier, [5]) == [True]
        after = tier.stats()
        assert after.entries == before.entries
        if self.exact_usage:
            assert after.used_bytes == before.used_bytes
        assert self._read(tier, [5]) == [blob(5, seal=tier.verifies)]

    def test_delete(self, new_tier):
        tier = new_tier()
        self._put(tier, [1, 2])
        tier.delete([key(1), key(42)])
        self.settle(tier)
        assert tier.contains([key(1), key(2)]) == [False, True]
        assert tier.stats().entries == 1

    def test_chunk_larger_than_tier_is_skipped(self, new_tier):
        tier = new_tier(4 * BLOB_BYTES)
        big = blob(7, shape=(2, 2, TOKENS * 8, 2, 32), seal=tier.verifies)
        assert tier.put([(key(7), BytesPayload(big))]) == [False]
        self.settle(tier)
        assert tier.contains([key(7)]) == [False]
        assert tier.stats().used_bytes <= tier.stats().capacity_bytes

    def test_delete_while_pinned_keeps_bytes_until_released(self, new_tier):
        tier = new_tier()
        self._put(tier, [3])
        with tier.get([key(3)]) as (view,):
            tier.delete([key(3)])
            self._put(tier, list(range(200, 210)))
            assert bytes(view) == blob(3, seal=tier.verifies)
        self.settle(tier)
        assert tier.contains([key(3)]) == [False]

    def test_concurrent_readers_and_writers(self, new_tier):
        tier = new_tier(16 * BLOB_BYTES)
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            try:
                for j in range(30):
                    i = (seed * 7 + j) % 24
                    self._put(tier, [i])
                    got = self._read(tier, [i])[0]
                    assert got is None or got == blob(i, seal=tier.verifies)
                    stats = tier.stats()
                    assert stats.used_bytes <= stats.capacity_bytes
            except BaseException as exc:  # collected and re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]


class EvictingTierConformance(TierConformance):
    """For tiers that evict by themselves: capacity is hard, order follows the policy, pins hold."""

    def test_capacity_never_exceeded(self, new_tier):
        capacity = 8 * BLOB_BYTES + BLOB_BYTES // 2
        tier = new_tier(capacity)
        for i in range(40):
            self._put(tier, [i])
            stats = tier.stats()
            assert stats.used_bytes <= stats.capacity_bytes <= capacity
        assert 0 < tier.stats().entries <= 8
        assert tier.contains([key(39)]) == [True]

    def test_lru_eviction_order(self, new_tier):
        tier = new_tier(4 * BLOB_BYTES + 100)
        for i in range(4):
            self._put(tier, [i])
        assert tier.contains([key(i) for i in range(4)]) == [True] * 4
        self._read(tier, [0])  # 0 is now the most recently used
        self._put(tier, [10])  # must evict 1, the least recently used
        assert tier.contains([key(i) for i in (0, 1, 2, 3, 10)]) == [True, False, True, True, True]

    def test_a_batch_is_a_chain_kept_from_its_root(self, new_tier):
        """A batch holds one request's chunks, root first (kvtier/policy/base.py): a tier reports it to its
        policy deepest chunk first, so what cannot stay is the end of the chain, never its start."""
        tier = new_tier(2 * BLOB_BYTES + 100)
        self._put(tier, [0, 1, 2])
        assert tier.contains([key(0), key(1), key(2)]) == [True, True, False]
        tier = new_tier(4 * BLOB_BYTES + 100)
        for i in (3, 2, 1, 0):
            self._put(tier, [i])  # stored oldest root: alone, LRU would evict 3 first, then 2 ...
        self._read(tier, [0, 1, 2, 3])  # ... read as one prefix, the deepest is the least recent again
        self._put(tier, [10])
        assert tier.contains([key(i) for i in (0, 1, 2, 3, 10)]) == [True, True, True, False, True]

    def test_pinned_entries_survive_pressure(self, new_tier):
        tier = new_tier(4 * BLOB_BYTES + 100)
        self._put(tier, [0, 1])
        with tier.get([key(0)]) as (view,):
            assert view is not None
            for i in range(100, 120):  # far more than fits: everything but the pinned entry churns
                self._put(tier, [i])
                assert bytes(view) == blob(0, seal=tier.verifies)
            assert tier.contains([key(0)]) == [True]
            assert tier.stats().used_bytes <= tier.stats().capacity_bytes

    def test_full_of_pinned_skips_store(self, new_tier):
        tier = new_tier(2 * BLOB_BYTES + 100)
        self._put(tier, [0, 1])
        with tier.get([key(0), key(1)]) as views:
            assert all(v is not None for v in views)
            assert self._put(tier, [2]) == [False]
        assert self._put(tier, [2]) == [True]  # pins released: it fits again

    def test_pins_released_when_reader_raises(self, new_tier):
        tier = new_tier(2 * BLOB_BYTES + 100)
        self._put(tier, [0, 1])
        with pytest.raises(RuntimeError):
            with tier.get([key(0), key(1)]):
                raise RuntimeError("reader failed")
        assert self._put(tier, [2]) == [True]  # 0 or 1 could be evicted, so they were unpinned


class EvictionListenerConformance:
    """Mix in (with EvictingTierConformance) for tiers that report evictions to a write-back tier."""

    def test_eviction_listener_sees_valid_bytes(self, new_tier):
        tier = new_tier(2 * BLOB_BYTES + 100)
        seen: dict[bytes, bytes] = {}
        tier.set_eviction_listener(lambda k, b: seen.__setitem__(bytes(k), bytes(b)))
        for i in range(3):
            self._put(tier, [i])
        assert seen == {key(0): blob(0, seal=tier.verifies)}


class RemovalListenerConformance:
    """Mix in (with EvictingTierConformance) for tiers that are RemovalReporter and Listable: every key that
    leaves is reported once, and the listing matches what is held."""

    def test_removals_are_reported_and_listing_matches(self, new_tier):
        tier = new_tier(3 * BLOB_BYTES + 100)
        gone: list[bytes] = []
        tier.set_removal_listener(lambda k: gone.append(bytes(k)))
        self._put(tier, [0, 1, 2])
        assert sorted(tier.list_keys()) == sorted([key(0), key(1), key(2)])
        self._put(tier, [3])  # evicts one of the first three, whichever the tier's policy picks
        self.settle(tier)
        held = {bytes(k) for k in tier.list_keys()}
        evicted = {key(0), key(1), key(2)} - held
        assert len(evicted) == 1 and key(3) in held and gone == list(evicted)
        deleted, kept = sorted(held - {key(3)})
        tier.delete([deleted, key(42)])
        self.settle(tier)
        assert gone == [*evicted, deleted]
        assert sorted(tier.list_keys()) == sorted([kept, key(3)])
        tier.set_removal_listener(None)
        tier.delete([kept])
        assert gone == [*evicted, deleted]

