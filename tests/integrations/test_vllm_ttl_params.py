"""How the connector's scheduler side reads a retention time from vLLM requests' ``kv_transfer_params`` (real
vLLM ``Request`` objects, no engine): the accepted shape, and malformed values ignored and counted once per
request instead of raised. The engine end to end: test_vllm_ttl.py."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvtier.integrations.vllm.lookup import LookupClient  # noqa: E402
from kvtier.integrations.vllm.lookups import Lookups  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide, request_ttl  # noqa: E402
from kvtier.tiers.control import MAX_TTL_S  # noqa: E402


def request(req_id: str, params: object = None) -> Request:
    extra = None if params is None else {"kv_transfer_params": params}
    return Request(req_id, list(range(10, 138)), SamplingParams(max_tokens=4, extra_args=extra), None)


def test_the_accepted_shape_and_no_retention_without_it() -> None:
    assert request_ttl(request("a", {"kvtier": {"ttl_s": 30}})) == 30.0
    assert request_ttl(request("b", {"kvtier": {"ttl_s": 0.5}})) == 0.5
    assert request_ttl(request("c")) is None
    assert request_ttl(request("d", {"other_connector": {"x": 1}})) is None
    assert request_ttl(request("e", {"kvtier": {}})) is None


@pytest.mark.parametrize("bad", [{"ttl_s": -5}, {"ttl_s": 0}, {"ttl_s": "30"}, {"ttl_s": True},
                                 {"ttl_s": float("inf")}, {"ttl_s": float("nan")}, {"ttl_s": 1e308},
                                 {"ttl_s": MAX_TTL_S + 1}, 30, "30"])
def test_malformed_values_raise_for_the_scheduler_to_ignore(bad: object) -> None:
    with pytest.raises(ValueError, match="kv_transfer_params.kvtier"):
        request_ttl(request("x", {"kvtier": bad}))


def test_the_scheduler_ignores_a_malformed_ttl_once_per_request_with_a_warning(tmp_path, caplog) -> None:
    lookups = Lookups(LookupClient([str(tmp_path / "none.sock")]), 0.1)
    side = SchedulerSide(64, 32, lookups)
    try:
        bad, good = request("bad", {"kvtier": {"ttl_s": -1}}), request("good", {"kvtier": {"ttl_s": 60}})
        with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm.scheduler"):
            assert [side._ttl(bad), side._ttl(bad), side._ttl(good)] == [None, None, 60.0]
        assert side.ignored_params == 1
        # vLLM exports what the scheduler's connector counted, once: an ignored request is never lost or doubled
        assert side.take_counters() == [["kvtier_engine_ignored_params_total", {}, 1]]
        assert side.take_counters() == []
        assert [r.getMessage() for r in caplog.records if "bad" in r.getMessage()] != []
        assert len(caplog.records) == 1
    finally:
        lookups.close()
