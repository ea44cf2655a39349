"""Conformance suite every AdmissionPolicy passes (kvtier/policy/admission.py states the contract).

Subclass ``AdmissionConformance`` and set ``name`` to a key of ``kvtier.policy.admission.ADMISSIONS``; pytest
collects the inherited tests. Each test runs the policy bare and behind a byte-rate cap with a generous rate
(``capped``), so the wrapper keeps every promise the policy makes.
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from kvtier.base.keys import ChunkHash
from kvtier.policy.admission import (
    ADMISSIONS,
    AdmissionPolicy,
    AdmissionSettings,
    Refusal,
    WriteSource,
    make_admission,
)


def key(i: int) -> ChunkHash:
    return ChunkHash(hashlib.sha256(f"admission-{i}".encode()).digest())


class AdmissionConformance:
    name: str

    @pytest.fixture(params=["bare", "capped"])
    def policy(self, request) -> AdmissionPolicy:
        cap = 10**15 if request.param == "capped" else None  # never reached by these tests
        return make_admission(AdmissionSettings(self.name, sketch_chunks=1024, max_bytes_per_s=cap),
                              clock=lambda: 0.0)

    def test_registered(self):
        assert self.name in ADMISSIONS

    def test_one_verdict_per_key_none_or_a_refusal(self, policy):
        keys = [key(i) for i in range(50)]
        for source in WriteSource:
            verdicts = policy.admit(keys, [1000] * len(keys), source)
            assert len(verdicts) == len(keys)
            assert all(v is None or isinstance(v, Refusal) for v in verdicts)
        assert policy.admit([], [], WriteSource.STORE) == []

    def test_a_key_sighted_twice_is_admitted_from_every_source(self, policy):
        keys = [key(i) for i in range(200)]
        policy.seen(keys)
        policy.seen(keys)
        for source in WriteSource:
            assert policy.admit(keys, [1] * len(keys), source) == [None] * len(keys)

    def test_a_promotion_is_admitted_unsighted(self, policy):
        """A promotion follows a hit: a reuse, which no policy may turn away for want of sightings."""
        keys = [key(10_000 + i) for i in range(100)]
        assert policy.admit(keys, [1] * len(keys), WriteSource.PROMOTE) == [None] * len(keys)

    def test_seen_refuses_nothing_and_accepts_empty(self, policy):
        policy.seen([])
        assert policy.seen([key(1)]) is None

    def test_concurrent_use_is_safe(self, policy):
        errors: list[BaseException] = []

        def work(base: int) -> None:
            try:
                for i in range(300):
                    keys = [key(base + i), key(base + i + 1)]
                    policy.seen(keys)
                    assert len(policy.admit(keys, [10, 10], WriteSource.STORE)) == 2
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n * 1000,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
