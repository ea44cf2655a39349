"""A ``kvtier route`` process never loads torch: it needs keys and a tokenizer, not tensors, and torch alone is
about 180 MB of its RSS.

The router's modules reach kvtier's key derivation (``KVSpec`` holds its dtype by name) but no tier, codec or
tensor code; a tokenizer folder naming the generic fast tokenizer is loaded without ``AutoTokenizer`` (whose
model-config imports load torch), and gives the ids ``AutoTokenizer`` gives.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness.router_load import ROOT, RouterProc, StubFleet
from kvtier.integrations.models import ensure_smollm2
from kvtier.net.ports import free_port

CHATS = [
    [{"role": "system", "content": "You answer briefly. " * 40}, {"role": "user", "content": "Hello there, router"}],
    [{"role": "user", "content": "naïve café 東京 — emojis 🙂 and\ttabs\n\nnew lines"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again  with   spaces"}],
]


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_a_routing_router_process_has_not_loaded_torch(tmp_path: Path) -> None:
    model = ensure_smollm2()
    port = free_port()
    with StubFleet(2) as fleet, RouterProc([sys.executable, "-m", "kvtier", "route", *[
            a for url in fleet.urls for a in ("--replica", url)], "--model", str(model), "--port", str(port),
            "--log-level", "warning"], port, log=tmp_path / "router.log") as router:
        router.wait_ready()
        for i, chat in enumerate(CHATS):  # routed: each chat rendered and tokenized by the router
            answer = httpx.post(router.url + "/v1/chat/completions", timeout=60,
                                json={"model": "m", "messages": chat, "max_tokens": 1, "user": f"s{i}"})
            assert answer.status_code == 200, answer.text
        maps = _maps(router.pid)
    assert "libtokenizers" in maps or "tokenizers" in maps  # the tokenizer is loaded: the maps are the real ones
    assert "libtorch" not in maps, "the router process mapped libtorch"


def test_the_router_modules_import_no_torch() -> None:
    code = ("import sys; import kvtier.apps.route.app, kvtier.apps.route.cli, kvtier.apps.route.workers; "
            "from kvtier.integrations.prompts import PromptTokenizer; PromptTokenizer(); "
            "print(json.dumps(sorted(m for m in ('torch', 'transformers.models.auto') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_replicas_published_namespace_is_read_without_torch() -> None:
    """What a cache-backed replica publishes at ``/kvtier/info`` (its namespace, with the KV dtype by name) is
    what the router's health probe reads: that read once imported torch into a running router."""
    code = ("import json, sys; from kvtier.base.keys import Namespace; from kvtier.base.layout import KVSpec; "
            "from kvtier.events.wire import namespace_from_json, namespace_json; "
            "ns = Namespace('m@main', KVSpec(30, 3, 64, 'bfloat16'), 256); "
            "back = namespace_from_json(json.loads(json.dumps(namespace_json(ns)))); "
            "print(json.dumps([back == ns, back.spec.dtype_key, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, "bfloat16", False]


@pytest.mark.parametrize("chat", CHATS)
def test_the_lean_tokenizer_gives_autotokenizers_ids(chat: list[dict[str, str]]) -> None:
    from transformers import AutoTokenizer

    from kvtier.integrations.prompts import _load

    folder = ensure_smollm2()
    lean, auto = _load(folder), AutoTokenizer.from_pretrained(folder)
    assert type(lean) is type(auto)
    for ready in (False, True):
        text = auto.apply_chat_template(chat, add_generation_prompt=ready, tokenize=False)
        assert lean.apply_chat_template(chat, add_generation_prompt=ready, tokenize=False) == text
        assert lean.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
        assert lean.encode(text) == auto.encode(text)


def test_the_session_and_prompt_caps_are_the_flags() -> None:
    import argparse

    from kvtier.apps.route.cli import add_parser, router_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["route", "--replica", "http://127.0.0.1:1", "--max-sessions", "7",
                              "--prompt-cache-entries", "3"])
    assert router_config(args).routing.build().max_sessions == 7
    from kvtier.integrations.prompts import PromptTokenizer

    tokenizer = PromptTokenizer(ensure_smollm2(), cache_entries=args.prompt_cache_entries)
    for i in range(20):  # twenty distinct sessions' chats: the prefix cache keeps the three latest
        tokenizer.chat([{"role": "user", "content": f"session {i} says hello"}])
    assert len(tokenizer.incremental._entries) == 3
