"""A small workload in the Mooncake format, generated (no data files needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.apps.sim.synthetic import SyntheticWorkload, write

SMALL = SyntheticWorkload(sessions=60, session_rate_per_s=2.0, apps=4, docs=15, doc_tokens=(1000, 6000), seed=1)
BLOCK_TOKENS = 16  # tokens per block in tests: the structure is what matters, and hashing stays cheap


@pytest.fixture(scope="session")
def small_trace(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("trace") / "small.jsonl", SMALL)
