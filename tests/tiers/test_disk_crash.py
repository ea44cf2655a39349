"""Crash safety and restarts of the disk tier, across real processes.

* SIGKILL: a child writing (and deleting, and evicting) chunks is killed at random moments, 120 times; after
  each batch of kills a fresh tier on the directory must return, for every key, exactly its bytes or a miss,
  and no temp file may survive its start-up.
* Restart: chunks stored through KVCache are retrieved byte-identical by a new Python process.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvtier.codecs import BytesPayload, get_codec
from kvtier.codecs.blob import blob_bytes, encode_blob
from tests.conformance.tier_suite import key
from tests.tiers.disk_helpers import disk_tier

N_KEYS = 40
KILLS = 120
SHAPE = (2, 2, 64, 4, 64)  # 256 KiB of float32 per chunk: big enough that kills land mid-write


def _blob(i: int) -> bytes:
    chunk = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 + i))
    tokens = np.arange(i, i + SHAPE[2], dtype="<u4")
    return bytes(blob_bytes(encode_blob(key(i), tokens, get_codec("raw"), chunk, seal=True)))


def _child(root: Path, blobs: list[bytes], seed: int) -> None:
    """Store, delete and read at random until killed. Capacity for half the keys, so it evicts too."""
    rng = random.Random(seed)
    tier = disk_tier(root, N_KEYS // 2 * len(blobs[0]), write_queue_depth=4)
    while True:
        i = rng.randrange(N_KEYS)
        action = rng.random()
        if action < 0.8:
            tier.put([(key(i), BytesPayload(blobs[i]))])
        elif action < 0.85:
            tier.delete([key(i)])
        else:
            with tier.get([key(i)]):
                pass
        time.sleep(0.001)  # let the writer keep up, so chunks accumulate between kills


def _check(root: Path, blobs: list[bytes]) -> int:
    tier = disk_tier(root, N_KEYS * len(blobs[0]))
    try:
        assert not list(root.rglob("*.tmp")), "temp files survived the start-up"
        with tier.get([key(i) for i in range(N_KEYS)]) as views:
            present = 0
            for i, view in enumerate(views):
                if view is not None:
                    assert bytes(view) == blobs[i], f"key {i} returned other bytes"
                    present += 1
        return present
    finally:
        tier.close()  # before the next fork: the child must not inherit the directory lock


def test_sigkill_at_random_moments_leaves_only_whole_chunks(tmp_path):
    blobs = [_blob(i) for i in range(N_KEYS)]
    rng = random.Random(1234)
    seen, torn = [], 0
    start = time.monotonic()
    for n in range(KILLS):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _child(tmp_path, blobs, seed=n)
            finally:
                os._exit(code)  # never reached unless the child failed
        time.sleep(rng.uniform(0.005, 0.2))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the child died on its own"
        torn += any(tmp_path.rglob("*.tmp"))  # killed in the middle of a write
        if n % 10 == 9:
            seen.append(_check(tmp_path, blobs))
    assert any(seen), "no chunk ever survived: the test exercised nothing"
    print(f"kills mid-write: {torn}/{KILLS}, present at checks: {seen}")
    assert torn >= KILLS // 10, f"only {torn} kills landed mid-write"
    assert time.monotonic() - start < 120


RESTART_SCRIPT = """
import hashlib, sys, torch
from kvtier import CacheConfig, KVCache, KVSpec
from kvtier.tiers import DiskTierConfig
spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
config = CacheConfig(chunk_size=16, tiers=(DiskTierConfig(path=sys.argv[1], capacity_bytes=1 << 26),))
with KVCache(spec, "restart-model@1", config) as cache:
    out, n = cache.retrieve(list(range(1000, 1080)))
    assert cache.metrics.get("kvtier_hit_tokens_total", tier="disk") == n
    print(n, hashlib.sha256(out[:, :, :n].contiguous().view(torch.uint16).numpy().tobytes()).hexdigest())
"""


def test_a_new_process_hits_with_identical_bytes(tmp_path):
    import hashlib

    from kvtier import CacheConfig, KVCache, KVSpec
    from kvtier.tiers import DiskTierConfig

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    config = CacheConfig(chunk_size=16, tiers=(DiskTierConfig(path=tmp_path, capacity_bytes=1 << 26),))
    kv = torch.randn(spec.chunk_shape(80)).to(torch.bfloat16)
    with KVCache(spec, "restart-model@1", config) as cache:
        assert cache.store(list(range(1000, 1080)), kv) == 80
    expected = f"80 {hashlib.sha256(kv.view(torch.uint16).numpy().tobytes()).hexdigest()}"

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", RESTART_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected  # all 80 tokens, the same bytes, served by the disk tier
