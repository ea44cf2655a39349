"""Replaying a kvtier bench result: the bench's own workload code rebuilds the prompts it sent."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kvtier.apps.sim.bench_replay import chat_token_ids, read_bench_json
from kvtier.apps.sim.fleet import FleetConfig, SimTier
from kvtier.apps.sim.replay import replay
from kvtier.base.errors import ConfigError
from kvtier.fleet.scoring import Routing, RoutingConfig
from kvtier.fleet.workloads import MultiRoundSpec, TraceSpec


def bench_file(tmp_path, workload: str, spec, requests: list[dict]):
    doc = {"config": {"workload": workload, "spec": dataclasses.asdict(spec), "targets": ["x"], "concurrency": 1},
           "summaries": [], "runs": [{"target": "kvtier", "workload": workload, "requests": requests}]}
    path = tmp_path / f"{workload}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def test_multiround_prompts_grow_turn_by_turn_and_hit(tmp_path):
    spec = MultiRoundSpec(users=2, rounds=3, system_words=120, turn_words=60)
    recorded = [{"round": r, "user": u, "text": f"answer {r} to user {u} " * 10, "sent_at": 2 * r + u * 0.5,
                 "status": 200, "completion_tokens": 16} for r in range(3) for u in range(2)]
    requests = read_bench_json(bench_file(tmp_path, "multiround", spec, recorded), chunk_tokens=16)
    assert len(requests) == 6 and [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert {r.session for r in requests} == {"multiround:0", "multiround:1"}
    by_user = [[r.prompt.tokens() for r in requests if r.session == f"multiround:{u}"] for u in range(2)]
    for prompts in by_user:  # each round's prompt extends the previous one (the recorded answer is in it)
        for before, after in zip(prompts, prompts[1:]):
            assert len(after) > len(before) and np.array_equal(after[: len(before) - 1], before[:-1])
    result = replay(requests, FleetConfig(tiers=(SimTier(chunks=1000),)), 16)
    assert result.hit_chunks > result.chunks / 3  # system prompt shared, histories reused


def test_multiround_context_words_is_the_first_message_only(tmp_path):
    """A conversation's own long context (``context_words``) opens it; later turns stay ``turn_words`` long, and
    the replay rebuilds the same prompts from the recorded spec."""
    spec = MultiRoundSpec(users=2, rounds=2, system_words=10, turn_words=5, context_words=200, sessions=True)
    recorded = [{"round": r, "user": u, "text": "ok", "sent_at": 2 * r + u, "status": 200, "completion_tokens": 1}
                for r in range(2) for u in range(2)]
    requests = read_bench_json(bench_file(tmp_path, "multiround", spec, recorded), chunk_tokens=16)
    first, second = (r.input_tokens for r in requests if r.session == "multiround:0")
    assert first > 200 and 5 < second - first < 20  # the answer, the role markers and a five-word turn
    plain = read_bench_json(bench_file(tmp_path, "multiround", dataclasses.replace(spec, context_words=0), recorded),
                            chunk_tokens=16)
    assert plain[0].input_tokens < 40


def test_trace_workload_prompts_are_the_token_ids_sent(tmp_path, small_trace):
    spec = TraceSpec(path=str(small_trace), requests=8, block_tokens=16, timestamps=True, speed=0.001)
    recorded = [{"round": i, "user": 0, "text": "", "sent_at": float(i)} for i in range(8)]
    requests = read_bench_json(bench_file(tmp_path, "trace", spec, recorded), chunk_tokens=16)
    assert len(requests) == 8  # and it did not wait for the trace's timestamps
    assert all(r.prompt.tokens().dtype == np.dtype("<u4") for r in requests)


def test_chat_tokens_are_prefix_preserving():
    one = chat_token_ids([{"role": "user", "content": "Hello, world"}])
    two = chat_token_ids([{"role": "user", "content": "Hello, world"}, {"role": "assistant", "content": "Hi!"}])
    assert np.array_equal(two[: len(one) - 1], one[:-1])


def test_unknown_target_or_workload_is_a_config_error(tmp_path):
    path = bench_file(tmp_path, "multiround", MultiRoundSpec(users=1, rounds=1), [])
    with pytest.raises(ConfigError, match="no run for target 'vllm'"):
        read_bench_json(path, chunk_tokens=16, target="vllm")
    doc = json.loads(path.read_text())
    doc["config"]["workload"] = "poetry"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="unknown workload"):
        read_bench_json(path, chunk_tokens=16)


def test_requests_replay_in_the_routers_decision_order_when_every_one_has_its_number(tmp_path):
    # users 1 and 2 of round 0 were sent 0.1 s apart and reached the router the other way round; a round-robin
    # router placed them in that order, so only the router's order replays its placements
    spec = MultiRoundSpec(users=3, rounds=1, system_words=4, turn_words=6)
    names = ("h:1", "h:2", "h:3")
    sent = {0: 0.0, 1: 1.0, 2: 1.1}
    decided = {0: 1, 1: 3, 2: 2}  # user 2's request was decided second
    recorded = [{"round": 0, "user": u, "text": "ok", "sent_at": sent[u], "status": 200, "completion_tokens": 1,
                 "replica": names[decided[u] - 1], "decision": decided[u], "ttft_s": 0.5, "e2e_s": 3.0}
                for u in range(3)]
    requests = read_bench_json(bench_file(tmp_path, "multiround", spec, recorded), chunk_tokens=16)
    assert [r.session for r in requests] == ["multiround:0", "multiround:2", "multiround:1"]
    assert [r.arrival_s for r in requests] == [0.0, 1.1, 1.1]  # arrivals never go back
    # ...but user 1's request still ends when it ended, so a replica it held is free when it was for the router
    assert requests[2].measured_e2e_s == pytest.approx(2.9) and requests[2].measured_ttft_s == pytest.approx(0.4)
    assert requests[1].measured_e2e_s == pytest.approx(3.0)
    round_robin = FleetConfig(replicas=3, tiers=(SimTier(chunks=100),), replica_names=names,
                              routing=RoutingConfig(Routing.ROUND_ROBIN))
    assert replay(requests, round_robin, 16).placements_matched == 3
    for row in recorded[1:]:  # one request without its number: the send order, and user 1 placed second
        row.pop("decision")
    requests = read_bench_json(bench_file(tmp_path, "multiround", spec, recorded), chunk_tokens=16)
    assert [r.session for r in requests] == ["multiround:0", "multiround:1", "multiround:2"]
    assert replay(requests, round_robin, 16).placements_matched == 1


def test_chat_prompts_become_the_served_models_token_ids_with_its_tokenizer(tmp_path):
    """With the served model's tokenizer a replayed chat prompt is the ids the server computed: as many as the
    bench recorded as the prompt's tokens, and each round's ids extend the previous round's."""
    from kvtier.integrations.prompts import PromptTokenizer

    tokenizer = PromptTokenizer()  # the packaged SmolLM2-135M-Instruct
    spec = MultiRoundSpec(users=1, rounds=2, system_words=20, turn_words=15, context_words=60)
    recorded = [{"round": r, "user": 0, "text": "a short answer", "sent_at": float(r), "status": 200,
                 "completion_tokens": 4} for r in range(2)]
    path = bench_file(tmp_path, "multiround", spec, recorded)
    requests = read_bench_json(path, chunk_tokens=16, tokenizer=tokenizer.chat)
    words = read_bench_json(path, chunk_tokens=16)
    first, second = (r.prompt.tokens() for r in requests)
    messages = [{"role": "system", "content": "x"}]  # the ids are the template's, not word-level ids
    assert list(first[:3]) == tokenizer.chat(messages)[:3] and list(first) != list(words[0].prompt.tokens())
    # what the server tokenizes: the chat template's text, ending in the assistant's turn (vLLM's generation prompt)
    assert tokenizer._tokenizer.decode(first).endswith("<|im_start|>assistant\n")
    # the next round's prompt starts with the first one's ids, up to the assistant's turn marker
    assert np.array_equal(second[: len(first) - 3], first[:-3])
