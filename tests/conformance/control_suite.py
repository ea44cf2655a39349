"""Conformance suite of the ``Controlled`` tier capability (kvtier/tiers/control.py): pins, expiry, tenant
shares and clears. Mix ``ControlConformance`` into a tier's conformance class (tier_suite.py) and implement
``make_controlled``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtier.base.errors import PinBudgetExceeded
from kvtier.codecs import BytesPayload
from kvtier.tiers import Tier
from kvtier.tiers.control import Controlled, Feature, Tags
from tests.conformance.tier_suite import BLOB_BYTES, FakeClock, TierConformance, blob, key


class ControlConformance:
    """Mix in for tiers that are ``Controlled`` (kvtier/tiers/control.py): pins hold against any pressure and
    within their budget, expired entries are misses and reclaimed, a tenant past its share evicts its own
    entries, clears are scoped. Implement ``make_controlled(capacity_bytes, clock, **config)`` (``config``: the
    ControlledTierConfig fields ``pin_budget_bytes``, ``tenant_share``, ``tenant_shares``). Features the tier
    lacks (its ``supports``) are skipped; a shared store whose server evicts sets ``enforces_shares`` and
    ``evicts`` False."""

    enforces_shares = True
    evicts = True
    #: an entry pinned past its expiry expires once unpinned (Redis: a pin drops the key's expiry for good)
    expires_after_unpin = True

    def make_controlled(self, capacity_bytes: int, clock: Callable[[], float], **config) -> Tier:
        raise NotImplementedError

    @pytest.fixture
    def controlled(self) -> Iterator[Callable[..., Tier]]:
        made: list[Tier] = []

        def factory(capacity_bytes: int = 16 * BLOB_BYTES, clock: Callable[[], float] | None = None,
                    **config) -> Tier:
            tier = self.make_controlled(capacity_bytes, clock or FakeClock(), **config)
            assert isinstance(tier, Controlled)
            made.append(tier)
            return tier

        yield factory
        for tier in made:
            tier.close()

    def _need(self, tier: Tier, feature: Feature) -> None:
        if feature not in tier.supports:
            pytest.skip(f"tier cannot {feature.value}")

    def _store(self, tier: Tier, ids: list[int], tags: Tags = Tags()) -> list[bool]:
        result = tier.put_tagged([(key(i), BytesPayload(blob(i, seal=tier.verifies))) for i in ids], tags)
        TierConformance.settle(self, tier)
        return result

    def test_control_pins_survive_any_pressure(self, controlled):
        tier = controlled(6 * BLOB_BYTES + 100, pin_budget_bytes=2 * BLOB_BYTES + 100)
        self._need(tier, Feature.PIN)
        self._store(tier, [0, 1, 2])
        assert tier.pin([key(0), key(1), key(42)]) >= 2 * BLOB_BYTES  # an absent key is ignored
        assert tier.pinned([key(0), key(1), key(2)]) == [True, True, False]
        self._store(tier, list(range(100, 130)))  # far more than fits: everything unpinned churns
        assert tier.contains([key(0), key(1)]) == [True, True]
        if self.evicts:
            assert tier.contains([key(2)]) == [False]
        tier.unpin([key(0), key(1)])
        assert tier.pinned([key(0), key(1)]) == [False, False]
        if self.evicts:
            self._store(tier, list(range(200, 230)))
            assert tier.contains([key(0), key(1)]) == [False, False]

    def test_pin_past_the_budget_is_refused_and_pins_nothing(self, controlled):
        tier = controlled(8 * BLOB_BYTES, pin_budget_bytes=BLOB_BYTES + BLOB_BYTES // 2)
        self._need(tier, Feature.PIN)
        self._store(tier, [0, 1])
        with pytest.raises(PinBudgetExceeded):
            tier.pin([key(0), key(1)])
        assert tier.pinned([key(0), key(1)]) == [False, False]
        assert tier.usage().pinned_bytes == 0
        assert tier.pin([key(0)]) > 0
        assert tier.pin([key(0)]) == 0  # pinning a pinned entry is a no-op

    def test_expired_entries_are_misses_and_reclaimed(self, controlled):
        clock = FakeClock()
        tier = controlled(clock=clock)
        self._need(tier, Feature.TTL)
        assert self._store(tier, [1, 2], Tags(expires_at=clock.now + 10)) == [True, True]
        self._store(tier, [3])
        assert tier.contains([key(1), key(2), key(3)]) == [True, True, True]
        clock.now += 11
        assert tier.contains([key(1), key(3)]) == [False, True]
        with tier.get([key(2), key(3)]) as views:
            assert views[0] is None and views[1] is not None
        TierConformance.settle(self, tier)
        assert tier.stats().entries == 1

    def test_a_pinned_entry_does_not_expire_until_unpinned(self, controlled):
        clock = FakeClock()
        tier = controlled(clock=clock)
        self._need(tier, Feature.TTL)
        self._need(tier, Feature.PIN)
        self._store(tier, [1], Tags(expires_at=clock.now + 10))
        tier.pin([key(1)])
        clock.now += 11
        assert tier.contains([key(1)]) == [True]
        tier.unpin([key(1)])
        if self.expires_after_unpin:
            assert tier.contains([key(1)]) == [False]

    def test_a_flood_of_one_tenant_stays_within_its_share(self, controlled):
        if not self.enforces_shares:
            pytest.skip("the server evicts: no shares")
        tier = controlled(8 * BLOB_BYTES + 100, tenant_share=0.5)
        self._need(tier, Feature.TENANTS)
        assert self._store(tier, [0, 1, 2], Tags("b")) == [True] * 3
        for i in range(100, 140):
            self._store(tier, [i], Tags("a"))
        assert tier.contains([key(0), key(1), key(2)]) == [True] * 3
        assert tier.contains([key(139)]) == [True]
        usage = tier.usage()
        assert 0 < usage.tenant_bytes["other"] - 3 * BLOB_BYTES <= 4 * BLOB_BYTES + 50
        assert tier.tags_of([key(0), key(139), key(7)]) == [Tags("b"), Tags("a"), None]

    def test_one_batch_stays_within_its_share_and_keeps_its_root(self, controlled):
        if not self.enforces_shares:
            pytest.skip("the server evicts: no shares")
        tier = controlled(16 * BLOB_BYTES + 100, tenant_share=0.25)
        self._need(tier, Feature.TENANTS)
        self._store(tier, list(range(10)), Tags("a"))  # one request's chain, root first
        assert tier.contains([key(i) for i in range(4)]) == [True] * 4
        assert tier.usage().tenant_bytes["other"] <= 4 * BLOB_BYTES + 100

    def test_clear_one_tenant_leaves_the_others(self, controlled):
        tier = controlled()
        self._need(tier, Feature.TENANTS)
        self._store(tier, [0, 1], Tags("a"))
        self._store(tier, [2], Tags("b"))
        self._store(tier, [3])
        if Feature.PIN in tier.supports:
            tier.pin([key(0)])  # a clear takes pinned entries too
        assert tier.clear(tenant="a") == 2
        TierConformance.settle(self, tier)
        assert tier.contains([key(0), key(1), key(2), key(3)]) == [False, False, True, True]
        assert tier.clear() == 2
        TierConformance.settle(self, tier)
        assert tier.contains([key(2), key(3)]) == [False, False]
