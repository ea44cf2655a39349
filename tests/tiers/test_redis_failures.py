"""A dead, hung or resetting Redis: requests keep completing as misses within the timeout, the circuit breaker
opens and closes again by itself, and hits return after a restart without restarting the clients."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.tiers.redis import servers
from tests.harness import timed, wait_for
from tests.tiers.test_redis import CHUNK, make_cache, prompt

TIMEOUT = 0.25
#: Far past the deadline: only a call that ignores its timeout (a hang) gets here. The deadline itself is
#: shown by counters (errors, breaker rejections), never by timing a loaded 2-core machine.
BOUND = TIMEOUT + 10.0


def test_hung_server_costs_at_most_the_timeout_then_breaker_opens_and_closes(own_redis):
    tokens, kv = prompt(4)
    with make_cache(own_redis.url, timeout_s=TIMEOUT, breaker_failures=2, breaker_cooldown_s=0.3) as cache:
        assert cache.store(tokens, kv) == len(tokens)
        assert cache.retrieve(tokens)[1] == len(tokens)
        own_redis.pause()  # accepts nothing, answers nothing: every call runs into its deadline
        try:
            calls = [(cache.lookup, (tokens,)), (cache.retrieve, (tokens,)), (cache.store, (tokens, kv))] * 3
            for fn, args in calls:
                result, seconds = timed(fn, *args)
                assert seconds < BOUND, (fn.__name__, seconds)
                assert (result[1] if isinstance(result, tuple) else result) == 0
            assert cache.metrics.total("kvtier_breaker_opens_total") == 1
            assert cache.metrics.total("kvtier_tier_errors_total") == 2  # then the breaker stopped the calls
            assert cache.metrics.total("kvtier_breaker_rejected_total") >= 6
            assert cache.metrics.get("kvtier_skipped_stores_total", tier="redis", reason="unavailable") > 0
            rejected = cache.metrics.total("kvtier_breaker_rejected_total")
            assert cache.lookup(tokens) == 0
            assert cache.metrics.total("kvtier_breaker_rejected_total") == rejected + 1  # open: never sent
            gauge = f'kvtier_breaker_open{{node="{own_redis.socket}",tier="redis"}} 1.0'
            assert gauge in cache.metrics.render_prometheus()
        finally:
            own_redis.resume()
        # the prober closes the breaker by itself; the data survived the freeze
        assert wait_for(lambda: cache.lookup(tokens) == len(tokens))
        assert cache.retrieve(tokens)[1] == len(tokens)


def test_server_killed_mid_run_then_restarted(own_redis):
    """Replica traffic in a thread; the server is killed, then started again on the same socket and port."""
    prompts = [prompt(3, seed=s) for s in range(4)]
    calls: list[tuple[str, float, int, float]] = []  # (op, seconds, result, when)
    stop = threading.Event()

    def replica(cache) -> None:
        i = 0
        while not stop.is_set() and i < 2000:
            tokens, kv = prompts[i % len(prompts)]
            for op, fn, args in (("lookup", cache.lookup, (tokens,)), ("retrieve", cache.retrieve, (tokens,)),
                                 ("store", cache.store, (tokens, kv))):
                result, seconds = timed(fn, *args)
                calls.append((op, seconds, result[1] if isinstance(result, tuple) else result, time.monotonic()))
            i += 1
            time.sleep(0.01)

    with make_cache(own_redis.tcp_url, timeout_s=TIMEOUT, breaker_failures=3, breaker_cooldown_s=0.3) as cache:
        thread = threading.Thread(target=replica, args=(cache,))
        thread.start()
        try:
            assert wait_for(lambda: any(op == "retrieve" and r == 3 * CHUNK for op, _, r, _ in calls))
            own_redis.kill()
            killed_at = time.monotonic()
            time.sleep(1.0)
            outage = [c for c in calls if c[3] > killed_at + 0.05]
            assert outage and all(r == 0 for op, _, r, _ in outage if op == "retrieve")
            own_redis.start()  # empty (no persistence), same socket and port; the clients are not restarted
            restarted_at = time.monotonic()
            assert wait_for(lambda: any(op == "retrieve" and r == 3 * CHUNK and t > restarted_at
                                        for op, _, r, t in calls), timeout=8.0)
        finally:
            stop.set()
            thread.join(timeout=30)
        slow = [(op, round(s, 3)) for op, s, _, _ in calls if s > BOUND]
        assert not slow, slow
        assert cache.metrics.total("kvtier_breaker_opens_total") >= 1
        assert cache.tiers[0]._servers.seed.breaker.state == 0  # closed again


def test_reset_connections_are_replaced_without_a_miss(own_redis):
    tokens, kv = prompt(3)
    with make_cache(own_redis.url, timeout_s=1.0) as cache:
        cache.store(tokens, kv)
        assert cache.retrieve(tokens)[1] == len(tokens)
        own_redis.cli("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # the server drops our pooled connection
        assert cache.retrieve(tokens)[1] == len(tokens)
        assert cache.metrics.total("kvtier_tier_errors_total") == 0


def test_no_server_at_all_is_misses_from_the_start(tmp_path):
    with make_cache(f"unix://{tmp_path}/nothing.sock", timeout_s=TIMEOUT, breaker_failures=1) as cache:
        tokens, kv = prompt(2)
        assert timed(cache.store, tokens, kv)[0] == 0
        assert cache.lookup(tokens) == 0
        assert cache.retrieve(tokens)[1] == 0
        assert cache.metrics.total("kvtier_breaker_opens_total") == 1


def test_unreachable_tcp_address_respects_connect_timeout():
    # 192.0.2.0/24 is TEST-NET-1 but must not be contacted; an unroutable loopback port is refused at once
    from kvtier.net.ports import free_port

    with make_cache(f"redis://127.0.0.1:{free_port()}/0", timeout_s=TIMEOUT) as cache:
        tokens, _ = prompt(1)
        result, seconds = timed(cache.lookup, tokens)
        assert result == 0 and seconds < BOUND


@pytest.mark.parametrize("threshold", [1, 3])
def test_breaker_threshold_and_probe(threshold):
    from kvtier.net.breaker import BreakerState, CircuitBreaker

    now = [0.0]
    changes = []
    breaker = CircuitBreaker(threshold, 1.0, on_change=changes.append, clock=lambda: now[0])
    for _ in range(threshold - 1):
        breaker.failure()
        assert breaker.allow()
    breaker.success()  # a success resets the count
    for _ in range(threshold):
        breaker.failure()
    assert not breaker.allow() and changes == [BreakerState.OPEN]
    assert not breaker.probe_due()
    now[0] = 1.5
    assert breaker.probe_due() and not breaker.probe_due()  # one probe per cool-down
    now[0] = 2.6
    assert breaker.probe_due()
    breaker.success()
    assert breaker.allow() and changes == [BreakerState.OPEN, BreakerState.CLOSED]


def test_a_health_probe_that_raises_does_not_end_the_tiers_recovery(own_redis, monkeypatch):
    """The tier's health thread probes an open breaker; a probe raising (injected: a bug) is logged, the thread
    goes on, and the breaker closes once the server is back, so stores reach it again."""
    real, calls = servers.probe, []

    def raises_once(node, timeout):
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("injected: a bug in one probe")
        return real(node, timeout)

    monkeypatch.setattr(servers, "probe", raises_once)
    tokens, kv = prompt(3)
    with make_cache(own_redis.tcp_url, timeout_s=TIMEOUT, breaker_failures=1, breaker_cooldown_s=0.1) as cache:
        own_redis.kill()
        cache.store(tokens, kv)  # fails: the breaker opens and the health thread starts probing
        own_redis.start()
        assert wait_for(lambda: cache.store(tokens, kv) == 3 * CHUNK, timeout=15.0)
        assert calls and cache.retrieve(tokens)[1] == 3 * CHUNK
