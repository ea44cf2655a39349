"""The engine thread of ``kvtier serve`` outlives what one request raises, and ``/health`` sees it if it dies.

The faults are injected into the real server (real uvicorn, real model, real HTTP): the model's generator raising
an error no model raises (a bug), and the thread's own loop dying of an exception it does not catch.
"""

from __future__ import annotations

import httpx
import pytest

from tests.apps.serve.conftest import start_server

PROMPT = "the cache keeps a prefix of every prompt so the server answers faster"


def _complete(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3})


@pytest.mark.timeout(120)
def test_a_request_whose_generation_raises_fails_alone_and_the_next_is_served(tiny_model_dir, monkeypatch):
    with start_server(tiny_model_dir) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        stream = live.backend.lm.stream
        calls = []

        def broken_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise ZeroDivisionError("injected: a bug in one request's work")
            return stream(*args, **kwargs)

        monkeypatch.setattr(live.backend.lm, "stream", broken_once)
        failed = _complete(client)
        assert failed.status_code == 500 and "ZeroDivisionError" in failed.json()["error"]["message"]
        served = _complete(client)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
        health = client.get("/health")
        assert health.status_code == 200 and health.json() == {**health.json(), "status": "ok", "in_flight": 0}


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected death
def test_an_engine_thread_that_dies_anyway_is_a_503_naming_it_and_no_request_hangs(tiny_model_dir, monkeypatch):
    with start_server(tiny_model_dir) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        engine = live.backend.engine

        def dies(job):
            raise SystemExit("injected: the loop itself ends")  # not an Exception: the loop does not catch it

        monkeypatch.setattr(engine, "_generate", dies)
        killed = _complete(client)  # the request it died on gets an answer, not a hang
        assert killed.status_code == 500 and "engine thread died" in killed.json()["error"]["message"]
        engine._thread.join(timeout=10)
        health = client.get("/health")
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "unhealthy" and "kvtier-engine" in health.json()["dead_threads"]
        later = _complete(client)  # refused at once, not queued for a thread that is gone
        assert later.status_code == 503 and "kvtier-engine" in later.json()["error"]["message"]
