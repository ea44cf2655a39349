"""Fixtures that run a real mooncake_master (see harness/mooncake_master.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import cache

import pytest

from harness.mooncake_master import MooncakeMaster, missing_mooncake

#: Clients whose heartbeats stop leave the pool after this many seconds (Mooncake's default is 10).
CLIENT_TTL_S = 2


@cache
def _missing() -> tuple[str, ...]:
    return tuple(missing_mooncake())


def require_mooncake() -> None:
    missing = _missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Mooncake tests; missing: {', '.join(missing)}")
        pytest.skip(f"missing {', '.join(missing)}")


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """One master shared by tests that only store and read (each uses its own key prefix or cleans up)."""
    require_mooncake()
    with MooncakeMaster(args=(f"--client_ttl={CLIENT_TTL_S}",)) as master:
        yield master


@pytest.fixture
def own_master() -> Iterator[MooncakeMaster]:
    """A master of the test's own, free to be killed, frozen and restarted."""
    require_mooncake()
    with MooncakeMaster(args=(f"--client_ttl={CLIENT_TTL_S}",)) as master:
        yield master
