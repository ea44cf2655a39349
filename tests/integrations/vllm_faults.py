"""Faults and traffic shapes for vllm_engine.py, on an in-process engine (worker and scheduler in this process).

Faults act on kvtier's side only (its tiers), never on vLLM: a tier that turns slow, a chunk that disappears
between the scheduler's lookup and the worker's load. Traffic shapes drive vLLM's own engine step by step:
aborting requests while their loads run, a request arriving while another one decodes, shutting down mid-load.
"""

from __future__ import annotations

import time


def worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def _first_tier():
    return worker().cache.tiers[0]


def slow(seconds: float) -> None:
    """Every read of the first tier waits ``seconds`` first (0: back to normal)."""
    tier = _first_tier()
    original = getattr(tier, "_unslowed_get", None) or tier.get
    tier._unslowed_get = original
    if seconds <= 0:
        tier.get = original
        return

    def get(keys):
        time.sleep(seconds)
        return original(keys)

    tier.get = get


def evict_on_load(prompt: list[int], chunk: int) -> None:
    """The next read of the prompt's chunk finds it deleted: a lookup before still saw it (every tier)."""
    cache = worker().cache
    key = cache.keys(prompt)[chunk]
    for tier in cache.tiers:
        original = tier.get

        def get(keys, tier=tier, original=original):
            if key in keys:
                tier.delete([key])
                tier.get = original
            return original(keys)

        tier.get = get


def preemptions(llm) -> int:
    """How many times vLLM's scheduler preempted a request so far."""
    return llm.llm_engine.engine_core.engine_core.scheduler._kvtier_preemptions


def count_preemptions(llm) -> None:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    scheduler._kvtier_preemptions = 0
    original = scheduler._preempt_request

    def preempt(*args, **kwargs):
        scheduler._kvtier_preemptions += 1
        return original(*args, **kwargs)

    scheduler._preempt_request = preempt


def _step_until(llm, done, limit_s: float = 120.0) -> list:
    outputs, deadline = [], time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError("engine did not get there in time")
        outputs.extend(llm.llm_engine.step())
    return outputs


def _loading() -> int:
    return len(worker().loads._active)


def _add(llm, prefix: str, prompts: list[list[int]], params) -> list[str]:
    from vllm.inputs import TokensPrompt

    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        llm.llm_engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), params)
    return ids


def abort_mid_load(llm, prompts: list[list[int]], params) -> dict:
    """Add the prompts, abort them once their loads run, and step until vLLM has nothing left."""
    ids = _add(llm, "abort", prompts, params)
    _step_until(llm, lambda: _loading() > 0)
    loading = _loading()
    llm.llm_engine.abort_request(ids)
    _step_until(llm, lambda: not llm.llm_engine.has_unfinished_requests() and _loading() == 0)
    return {"loading_when_aborted": loading}


def arrive_while_decoding(llm, prompts: list[list[int]], params, decoded: int) -> list[dict]:
    """Prompt 0 alone; once it has ``decoded`` output tokens, the others; every prompt's output."""
    first = _add(llm, "early", prompts[:1], params)[0]
    seen: dict[str, object] = {}

    def first_decoding() -> bool:
        for out in llm.llm_engine.step():
            seen[out.request_id] = out
        out = seen.get(first)
        return out is not None and len(out.outputs[0].token_ids) >= decoded

    _step_until(llm, first_decoding)
    assert not seen[first].finished, "prompt 0 finished before the others arrived: raise max_tokens"
    later = _add(llm, "late", prompts[1:], params)
    for out in _step_until(llm, lambda: not llm.llm_engine.has_unfinished_requests()):
        seen[out.request_id] = out
    return [{"tokens": list(seen[r].outputs[0].token_ids), "cached": seen[r].num_cached_tokens}
            for r in [first, *later]]


def start_loads(llm, prompts: list[list[int]], params) -> int:
    """Add the prompts and step until their loads run; how many run (the caller then shuts down)."""
    _add(llm, "exit", prompts, params)
    _step_until(llm, lambda: _loading() > 0)
    return _loading()
