"""Fixtures of the serve tests: the tiny model (built once a session) and a live server with a client over it
(harness/serve.py builds and serves them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.serve import LiveServer, build_tiny_model, start_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def server(tiny_model_dir) -> Iterator[LiveServer]:
    with start_server(tiny_model_dir) as live:
        yield live


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
