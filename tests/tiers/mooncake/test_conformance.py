"""The Mooncake tier passes the tier conformance suite against a real mooncake_master.

Each tier contributes its own 16 MiB segment and the pool holds nothing else, so a test starts with an empty
pool: closing a tier takes its segment, and every value in it, out of the pool.
"""

from __future__ import annotations

import pytest

from kvtier.tiers import MooncakeTier
from tests.conformance.tier_suite import TierConformance
from tests.tiers.mooncake.helpers import make_tier


class TestMooncakeTierConformance(TierConformance):
    @pytest.fixture(autouse=True)
    def _pool(self, mooncake_master):
        self.master = mooncake_master
        assert self.master.metrics()["master_key_count"] == 0, "a previous test left values in the pool"

    def make_tier(self, capacity_bytes: int) -> MooncakeTier:
        return make_tier(self.master, max_value_bytes=capacity_bytes)
