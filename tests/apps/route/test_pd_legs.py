"""``kvtier route --prefill ... --decode ...``: the two legs' bodies and the flags (the legs on real vLLM servers are
tests/integrations/test_vllm_pd.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier.apps.route.cli import add_parser, router_config
from kvtier.apps.route.pd import PDRouter, decode_body, prefill_body
from kvtier.base.errors import ConfigError


def test_the_prefill_leg_computes_one_token_and_asks_for_a_remote_decode():
    client = {"model": "m", "prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 3,
              "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
              "kv_transfer_params": {"kvtier": {"ttl_s": 30}}}
    body = json.loads(prefill_body(client))
    assert body == {"model": "m", "prompt": "hi", "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": {"kvtier": {"ttl_s": 30}, "do_remote_decode": True}}


def test_the_decode_leg_is_the_clients_request_with_the_returned_params():
    client = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
              "kv_transfer_params": {"kvtier": {"ttl_s": 30}, "do_remote_prefill": "client's"}}
    returned = {"do_remote_prefill": True, "do_remote_decode": False, "kvtier_pd": {"nonce": "ab" * 16}}
    body = json.loads(decode_body(client, returned))
    assert body == {**client, "kv_transfer_params": {"kvtier": {"ttl_s": 30}, **returned}}


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["route", *argv])


@pytest.mark.parametrize("argv", [(), ("--prefill", "http://a:1"), ("--decode", "http://a:1"),
                                  ("--replica", "http://a:1", "--prefill", "http://b:1", "--decode", "http://c:1")])
def test_pools_are_replicas_or_prefill_with_decode(argv):
    with pytest.raises(ConfigError, match="--prefill"):
        router_config(args(*argv))


def test_a_replica_cannot_be_in_both_pools():
    config = router_config(args("--prefill", "http://a:1", "--decode", "http://b:1"))
    assert [r.url for r in config.replicas] == ["http://a:1"]
    with pytest.raises(ConfigError, match="both"):
        PDRouter(config, ("http://a:1",), tokenizer=None)
