"""``kvtier route`` without ``--model``: the model the replicas name at /v1/models if its tokenizer is at hand,
else one line saying to pass --model and exit status 2; never a traceback, never another model's tokenizer.
Real processes: stand-in replicas (harness.stub_replica) and the ``kvtier route`` command."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from harness.router_load import ROOT, RouterProc, StubFleet
from harness.serve import build_tiny_model
from kvtier.net.ports import free_port


def route(urls: list[str], *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvtier", "route", "--port", str(free_port()), *flags]
    for url in urls:
        cmd += ["--replica", url]
    return subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr


def test_replicas_that_name_no_model_need_model():
    with StubFleet(2) as fleet:
        err = one_line_error(route(fleet.urls))
    assert "--model" in err and "/v1/models" in err


def test_a_named_model_whose_tokenizer_is_not_here_needs_model():
    with StubFleet(1, model="example-org/no-such-model-7b") as fleet:
        err = one_line_error(route(fleet.urls))
    assert "--model" in err and "example-org/no-such-model-7b" in err


def test_a_model_folder_that_holds_no_tokenizer_is_a_one_line_error(tmp_path):
    with StubFleet(1) as fleet:
        err = one_line_error(route(fleet.urls, "--model", str(tmp_path)))
    assert str(tmp_path) in err


@pytest.mark.parametrize("named", [True, False])
def test_the_router_uses_the_named_model_or_model(tmp_path, named):
    model = build_tiny_model(tmp_path / "model")
    with StubFleet(2, model=str(model) if named else None) as fleet:
        port = free_port()
        cmd = [sys.executable, "-m", "kvtier", "route", "--port", str(port), "--log-level", "warning"]
        cmd += [] if named else ["--model", str(model)]
        for url in fleet.urls:
            cmd += ["--replica", url]
        with RouterProc(cmd, port) as router:
            router.wait_ready()
            body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
            answer = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200 and answer.json()["served_by"] in fleet.ports


def test_replicas_that_name_the_packaged_model_get_its_tokenizer():
    """A default ``kvtier serve`` names SmolLM2-135M-Instruct, the model kvtier ships: its tokenizer is at hand."""
    with StubFleet(1, model="SmolLM2-135M-Instruct") as fleet:
        port = free_port()
        cmd = [sys.executable, "-m", "kvtier", "route", "--port", str(port), "--log-level", "warning",
               "--replica", fleet.urls[0]]
        with RouterProc(cmd, port) as router:
            router.wait_ready()
            body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
            answer = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200 and answer.json()["served_by"] in fleet.ports
