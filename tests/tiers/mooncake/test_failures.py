"""A dead, hung or absent master: requests keep completing as misses within the timeout, the circuit breaker
opens and closes again by itself, and hits return after a restart without restarting the replicas."""

from __future__ import annotations

from harness.process import timed, wait_for
from tests.tiers.mooncake.helpers import make_cache, prompt

TIMEOUT = 0.5
#: Far past the deadline: only a call that ignores its timeout (a hang) gets here. The deadline itself is
#: shown by counters (errors, breaker rejections), never by timing a loaded 2-core machine.
BOUND = TIMEOUT + 10.0
FAST = {"timeout_s": TIMEOUT, "breaker_failures": 2, "breaker_cooldown_s": 0.3}



def misses_within_bound(cache, tokens, kv) -> None:
    for fn, args in [(cache.lookup, (tokens,)), (cache.retrieve, (tokens,)), (cache.store, (tokens, kv))] * 3:
        result, seconds = timed(fn, *args)
        assert seconds < BOUND, (fn.__name__, seconds)
        assert (result[1] if isinstance(result, tuple) else result) == 0, fn.__name__


def test_master_killed_then_restarted(own_master):
    tokens, kv = prompt(4)
    with make_cache(own_master, **FAST) as cache:
        assert cache.store(tokens, kv) == len(tokens)
        own_master.kill()
        misses_within_bound(cache, tokens, kv)
        assert cache.metrics.total("kvtier_breaker_opens_total") >= 1
        assert cache.metrics.get("kvtier_skipped_stores_total", tier="mooncake", reason="unavailable") > 0
        own_master.restart()  # same ports; the old master's metadata (every chunk's location) is gone
        # the replica rejoins by itself: its next stores land in the pool again and are hits
        assert wait_for(lambda: cache.store(tokens, kv) == len(tokens))
        out, n = cache.retrieve(tokens)
        assert n == len(tokens) and out.equal(kv)
        assert own_master.metrics()["master_total_capacity_bytes"] == 16 << 20  # its segment is back


def test_hung_master_costs_at_most_the_timeout_then_breaker_opens_and_closes(own_master):
    tokens, kv = prompt(4)
    with make_cache(own_master, **FAST) as cache:
        assert cache.store(tokens, kv) == len(tokens)
        own_master.pause()  # accepts connections, answers nothing
        try:
            misses_within_bound(cache, tokens, kv)
            assert cache.metrics.total("kvtier_breaker_opens_total") == 1
            assert cache.metrics.total("kvtier_breaker_rejected_total") >= 6
            rejected = cache.metrics.total("kvtier_breaker_rejected_total")
            assert cache.lookup(tokens) == 0
            assert cache.metrics.total("kvtier_breaker_rejected_total") == rejected + 1  # open: never sent
            gauge = f'kvtier_breaker_open{{node="{own_master.master_address}",tier="mooncake"}}'
            assert cache.metrics.snapshot()[gauge] == 1
        finally:
            own_master.resume()
        # the prober closes the breaker; the chunks survived the freeze
        assert wait_for(lambda: cache.lookup(tokens) == len(tokens))
        out, n = cache.retrieve(tokens)
        assert n == len(tokens) and out.equal(kv)


def test_no_master_at_start_is_misses_until_it_comes(own_master):
    tokens, kv = prompt(2)
    own_master.kill()
    (cache, seconds) = timed(lambda: make_cache(own_master, connect_timeout_s=1.0, **FAST))
    with cache:
        assert seconds < 1.0 + BOUND
        assert not cache.tiers[0].joined
        for fn, args in [(cache.lookup, (tokens,)), (cache.store, (tokens, kv)), (cache.retrieve, (tokens,))]:
            result, seconds = timed(fn, *args)
            assert seconds < BOUND
            assert (result[1] if isinstance(result, tuple) else result) == 0
        assert cache.metrics.get("kvtier_skipped_stores_total", tier="mooncake", reason="unavailable") == 2
        assert cache.metrics.snapshot()['kvtier_mooncake_joined{tier="mooncake"}'] == 0
        own_master.restart()
        assert wait_for(lambda: cache.tiers[0].joined)  # it kept trying by itself
        assert cache.store(tokens, kv) == len(tokens)
        assert cache.retrieve(tokens)[1] == len(tokens)
