"""The vLLM connector's per-rank server (kvtier.integrations.vllm.admin) in a process of its own, over a real
KVCache without an engine, for tests that count its threads and descriptors from outside.

    python -m tests.integrations.rank_server ADMIN_KEY [--dying-thread]

Prints the port it serves on, then serves until killed. With ``--dying-thread`` it also runs a long-lived thread
watched as kvtier's own are (kvtier.base.threads), ``kvtier-test-worker``, which raises (dies) when a line
arrives on stdin: what the server's ``/health`` must then report.
"""

from __future__ import annotations

import sys
import threading

import torch

from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.base.threads import WATCHED
from kvtier.integrations.vllm.admin import AdminServer, token_prompt


def _worker() -> None:
    sys.stdin.readline()
    raise RuntimeError("the test killed this thread")


if __name__ == "__main__":
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    config = CacheConfig.from_dict({"chunk_size": 16, "tiers": [
        {"kind": "memory", "capacity_bytes": "4MiB", "prefault": False}]})
    with KVCache(spec, model="tiny@main", config=config) as cache:
        server = AdminServer(cache, 0, "127.0.0.1", name="tiny@main", prompt=token_prompt(1000, 512),
                             admin_key=sys.argv[1])
        worker = threading.Thread(target=_worker, name="kvtier-test-worker", daemon=True)
        if "--dying-thread" in sys.argv[2:]:
            WATCHED.watch(worker).start()
        print(server.port, flush=True)
        threading.Event().wait()
