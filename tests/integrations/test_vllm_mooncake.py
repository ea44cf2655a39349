"""Two vLLM engine processes share prefixes through a real Mooncake pool (KVTierConnector, CPU build).

The pool's memory comes from a separate pool member (harness/mooncake_master.SegmentHost): the engines run one
after the other, and a replica's values leave the pool with it, so the member that holds them outlives both.
Engine one computes three prompts and stores their chunks in the pool; engine two, a new process with an
empty vLLM prefix cache and no other tier, loads them from the pool and generates the same tokens.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from tests.integrations.test_vllm import CHUNK, FULL_HITS, cached, engine, tokens, workdir  # noqa: E402,F401
from harness.mooncake_master import MooncakeMaster, SegmentHost  # noqa: E402
from tests.tiers.mooncake.conftest import require_mooncake  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    require_mooncake()
    with MooncakeMaster() as master, SegmentHost(master, 256 << 20):
        yield master


def pool_tiers(master: MooncakeMaster) -> str:
    tier = {"kind": "mooncake", "master_address": master.master_address, "metadata_server": master.metadata_url,
            "metrics_url": master.metrics_url, "segment_bytes": 0, "buffer_bytes": "16MiB", "timeout_s": 5.0}
    return json.dumps({"chunk_size": CHUNK, "tiers": [tier]})


def test_second_engine_process_loads_the_first_ones_prefixes_from_the_pool(engine, pool):  # noqa: F811 (fixture)
    # each engine in one process (scheduler and worker together: a quarter of the start-up time of vLLM's
    # default layout here, which tests/integrations/test_vllm.py covers)
    first = engine("pool-first", pool_tiers(pool), ("gen:cold", "reset", "gen:warm"), in_process=True)
    assert cached(first["cold"]) == [0, 0, 0]
    assert cached(first["warm"]) == FULL_HITS  # its own chunks, back from the pool
    assert tokens(first["warm"]) == tokens(first["cold"])
    assert pool.metrics()["master_key_count"] == 4 + 4 + 1  # the prompts' full chunks of 64 tokens
    second = engine("pool-second", pool_tiers(pool), ("gen:first",), in_process=True)
    assert cached(second["first"]) == FULL_HITS  # every cached token came from the pool
    assert tokens(second["first"]) == tokens(first["cold"])
