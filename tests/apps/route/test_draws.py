"""A random tie-break draws from the request's prompt digest: random across prompts, the same for one prompt
whatever the order requests come in, and the same in ``kvtier sim``'s replay of a bench run as in the router."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json

from kvtier.apps.route.requests import parse_request
from kvtier.apps.sim.bench_replay import _draw_key, _ReplayRunner, read_bench_json
from kvtier.fleet import workloads as wl
from kvtier.fleet.draws import prompt_digest
from kvtier.fleet.scoring import ReplicaView, RouteRequest, Routing, RoutingConfig, TieBreak
from kvtier.fleet.workloads import MultiRoundSpec

IDLE = [ReplicaView(name=n) for n in ("r0", "r1", "r2")]


def random_policy(seed: int = 0):
    return RoutingConfig(Routing.LOAD_BOUNDED, epsilon=10.0, tie_break=TieBreak.RANDOM, seed=seed).build()


def request(n: int) -> RouteRequest:
    return RouteRequest(100, b"k" * 32, draw_key=prompt_digest(text=f"prompt {n}"))


def test_keyed_draws_spread_prompts_and_do_not_depend_on_order_or_earlier_requests():
    picks = [random_policy().choose(request(n), IDLE) for n in range(600)]
    counts = collections.Counter(picks)
    assert set(counts) == {0, 1, 2} and min(counts.values()) > 150
    policy = random_policy()
    backwards = [policy.choose(request(n), IDLE) for n in reversed(range(600))]
    assert backwards[::-1] == picks  # one policy, the other order: the same draw per prompt
    assert [random_policy(1).choose(request(n), IDLE) for n in range(600)] != picks  # the seed moves them
    unkeyed = random_policy()
    assert len({unkeyed.choose(RouteRequest(100, b"k" * 32), IDLE) for _ in range(60)}) == 3  # the generator
    cached = [dataclasses.replace(v, cached={"GPU": 64} if i == 2 else {}) for i, v in enumerate(IDLE)]
    assert all(random_policy().choose(request(n), cached) == 2 for n in range(50))  # a cached prefix is no tie


def test_digests_name_the_prompt_as_the_router_reads_it():
    chat = [{"role": "user", "content": "hello"}]
    assert prompt_digest(messages=chat) == prompt_digest(messages=[{"role": "user", "content": "hello"}])
    assert len({prompt_digest(messages=chat), prompt_digest(messages=[{"role": "system", "content": "hello"}]),
                prompt_digest(text="hello"), prompt_digest(ids=[1, 2]), prompt_digest(ids=[1, 2, 3])}) == 5
    assert prompt_digest() == b""
    developer = json.dumps({"model": "m", "messages": [{"role": "developer", "content": [
        {"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}]}).encode()
    parsed = parse_request(developer, True, {}).prompt
    assert prompt_digest(messages=parsed.messages) == prompt_digest(
        messages=[{"role": "system", "content": "be brief"}])
    for prompt in ([5, 6, 7], "once upon"):  # completions (the trace workload sends token ids), as replayed
        parsed = parse_request(json.dumps({"model": "m", "prompt": prompt}).encode(), False, {}).prompt
        assert prompt_digest(messages=parsed.messages, text=parsed.text, ids=parsed.ids) == _draw_key(
            {"prompt": prompt})


def test_the_simulator_replays_a_bench_run_with_the_digests_the_router_drew_from(tmp_path):
    spec = MultiRoundSpec(users=2, rounds=2, system_words=5, context_words=20, turn_words=4, max_tokens=2,
                          sessions=True)
    runner = _ReplayRunner({})  # the workload's prompts, as the bench sent them
    asyncio.run(wl.WORKLOADS["multiround"](runner, spec=spec))
    requests = [{"round": r, "user": u, "status": 200, "ttft_s": 0.1, "e2e_s": 0.2, "sent_at": float(i),
                 "prompt_tokens": 10, "cached_tokens": 0, "completion_tokens": 2, "text": "", "error": ""}
                for i, (r, u, _) in enumerate(runner.sent)]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"config": {"workload": "multiround", "spec": dataclasses.asdict(spec)},
                                "runs": [{"target": "t", "requests": requests}]}))
    replayed = read_bench_json(path, chunk_tokens=16)
    router = [prompt_digest(messages=parse_request(json.dumps(body).encode(), True, {}).prompt.messages)
              for _, _, body in runner.sent]
    assert sorted(r.draw_key for r in replayed) == sorted(router) and len(set(router)) == len(router)
