"""Two engine replicas (separate processes, each with its own KVCache) share prefixes through one server."""

from __future__ import annotations

import multiprocessing as mp

import torch

from tests.tiers.test_redis import CHUNK, SPEC, make_cache, prompt


def _replica(url: str, role: str, results) -> None:  # runs in a fresh (spawned) process
    try:
        system, kv_system = prompt(4, seed=7)  # a shared system prompt: 4 chunks
        with make_cache(url, max_part_bytes=4096) as cache:  # split values on the way, too
            if role == "first":
                results.put((role, cache.lookup(system), cache.store(system, kv_system)))
            else:
                # same system prompt plus this replica's own user turn
                user, kv_user = prompt(2, seed=8)
                tokens = system + user
                kv = torch.cat([kv_system, kv_user], dim=2)
                cached = cache.lookup(tokens)
                out, n = cache.retrieve(tokens)
                same = n > 0 and torch.equal(out[:, :, :n], kv[:, :, :n])
                stored = cache.store(tokens, kv)
                results.put((role, cached, n, same, stored))
    except BaseException as exc:  # reported to the parent, which fails the test
        results.put((role, "error", repr(exc)))


def _run(ctx, url: str, role: str, results) -> tuple:
    proc = ctx.Process(target=_replica, args=(url, role, results))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 0, f"{role} replica exited with {proc.exitcode}"
    return results.get(timeout=5)


def test_two_processes_share_prefixes(redis_server):
    redis_server.flush()
    ctx = mp.get_context("spawn")  # nothing inherited: a real second replica
    results = ctx.Queue()
    first = _run(ctx, redis_server.url, "first", results)
    assert first == ("first", 0, 4 * CHUNK)
    second = _run(ctx, redis_server.url, "second", results)
    assert second == ("second", 4 * CHUNK, 4 * CHUNK, True, 2 * CHUNK)  # hit the first's 4, added its own 2
    # a third reader here sees both replicas' chunks
    system, _ = prompt(4, seed=7)
    user, _ = prompt(2, seed=8)
    with make_cache(redis_server.url, max_part_bytes=4096) as cache:
        assert cache.lookup(system + user) == 6 * CHUNK
        assert cache.spec == SPEC
