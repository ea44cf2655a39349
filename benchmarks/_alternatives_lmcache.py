"""LMCache's half of ``benchmarks/alternatives.py``; runs in LMCache's own interpreter (scripts/lmcache-venv.sh).

Installing LMCache 0.5.6 into kvtier's environment would change versions installed there (numpy, protobuf,
transformers, ...), so it lives in a virtual environment of its own, and this script is started there as a
subprocess. It never imports kvtier.

Protocol: one JSON object per line on stdin, one JSON object per line answered on the original stdout (LMCache's
own log lines go to stderr). The first answer, unasked, is ``{"ready": ..., "kv_sha256": ...}``; then each
``{"op": "round", "tier": "memory" | "disk"}`` is answered with that round's seconds (a plain copy of the
KV, store, for disk the fsync of LMCache's files, retrieve) and checks; ``{"op": "quit"}`` ends it.
Numbers only cross the pipe, as JSON: no tensor, no pickle.

What runs is LMCache's in-process engine (``LMCacheEngine.store`` / ``retrieve``: its chunk hashing, its memory
allocator, its storage manager and backends), built once per tier:

- ``memory``: ``local_cpu: true`` and no disk (LMCache's L1 RAM backend, ``LocalCPUBackend``);
- ``disk``: ``local_cpu: false`` and ``local_disk`` set (``LocalDiskBackend``; with ``local_cpu`` off, a read
  from disk is not kept in RAM, so every round reads the disk).

Between the engine and the KV, LMCache puts a "GPU connector". Its vLLM connectors refuse any device but CUDA
(``VLLMPagedMemGPUConnectorV2._initialize_pointers`` asserts it), and its standalone mode uses a mock connector
that copies nothing, so the KV here passes through ``CopyConnector`` below: a plain ``copy_`` of each chunk's
token range between a host tensor in LMCache's ``KV_2LTD`` layout ``[2, layers, tokens, heads * head_dim]`` and
LMCache's memory object, which is the copy a CPU engine's connector would make.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch


def _connector_class():
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class CopyConnector(GPUConnectorInterface):
        """Copies chunk ``[start, end)`` between ``kv=`` / ``out=`` (host tensors, KV_2LTD) and a memory object."""

        def __init__(self, layers: int, hidden: int) -> None:
            self.layers, self.hidden, self.kvcaches = layers, hidden, None

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.layers, num_tokens, self.hidden])

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
            memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end])

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
            kwargs["out"][:, :, start:end].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
            for obj, start, end in zip(memory_objs, starts, ends):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
            for obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(obj, start, end, **kwargs)

    return CopyConnector


def make_kv(tokens: int, layers: int, heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """The benchmark's KV in LMCache's layout; alternatives.py builds the same tensor from the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, layers, tokens, heads * head_dim), generator=gen).to(torch.bfloat16)


def kv_digest(kv: torch.Tensor) -> str:
    return hashlib.sha256(kv.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def build_engine(name: str, args, kv_bytes: int, disk: Path | None):
    """An LMCacheEngine holding the whole KV in RAM (``disk`` None) or on disk only (``local_cpu`` off)."""
    from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    ram_gb = max(0.25, 2 * kv_bytes / 2**30)  # room for two copies: nothing is evicted mid-round
    # LMCache 0.5.6's LocalDiskBackend.remove deletes the file but does not give its bytes back to the capacity
    # that admits new writes (``current_cache_size``), so each round's removed KV stays counted: room for all.
    disk_gb = (args.rounds + 2) * kv_bytes / 2**30
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=args.chunk_size, local_cpu=disk is None, max_local_cpu_size=ram_gb,
        local_disk=None if disk is None else f"file://{disk}", max_local_disk_size=0 if disk is None else disk_gb,
        extra_config={"use_odirect": args.odirect})
    metadata = LMCacheMetadata(
        model_name="bench-smollm2-shape", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(args.layers, 2, args.chunk_size, args.heads, args.head_dim))
    connector = _connector_class()(args.layers, args.heads * args.head_dim)
    engine = LMCacheEngineBuilder.get_or_create(name, config, metadata, connector, mock_up_broadcast_fn,
                                                mock_up_broadcast_object_fn)
    engine.post_init()
    return engine


def drop_page_cache(folder: Path) -> str:
    """As benchmarks/_util.evict_page_cache: drop_caches where allowed, else fadvise DONTNEED on ``folder``."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        for file in folder.rglob("*"):
            if file.is_file():
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise"


def fsync_files(folder: Path) -> None:
    """What LMCache's disk backend does not do: make its chunk files durable (kvtier's disk tier fsyncs each)."""
    for file in folder.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class Side:
    """Both engines, the KV, and one measured round per request."""

    def __init__(self, args) -> None:
        self.args = args
        self.kv = make_kv(args.tokens, args.layers, args.heads, args.head_dim, args.seed)
        self.tokens = torch.arange(args.tokens)
        kv_bytes = self.kv.numel() * self.kv.element_size()
        self.dir = Path(tempfile.mkdtemp(prefix="lmcache-bench-", dir=args.dir))
        self.engines = {"memory": build_engine("bench-memory", args, kv_bytes, None),
                        "disk": build_engine("bench-disk", args, kv_bytes, self.dir)}
        self.out = torch.zeros_like(self.kv)
        self.scratch = torch.zeros_like(self.kv)
        n_chunks = args.tokens // args.chunk_size
        self.chunks = [torch.zeros((2, args.layers, args.chunk_size, args.heads * args.head_dim), dtype=torch.bfloat16)
                       for _ in range(n_chunks)]

    def _keys(self, engine) -> list:
        return [key for _start, _end, key in engine.token_database.process_tokens(self.tokens)]

    def _connector_alone(self) -> dict:
        """The connector's copies alone, chunk by chunk into and out of plain tensors: what LMCache's engine adds
        on top of them is the rest of its store / retrieve time."""
        size = self.args.chunk_size
        start = time.perf_counter()
        for i, chunk in enumerate(self.chunks):
            chunk.copy_(self.kv[:, :, i * size:(i + 1) * size])
        into = time.perf_counter() - start
        start = time.perf_counter()
        for i, chunk in enumerate(self.chunks):
            self.out[:, :, i * size:(i + 1) * size].copy_(chunk)
        return {"connector_store_s": into, "connector_retrieve_s": time.perf_counter() - start}

    def round(self, tier: str) -> dict:
        engine = self.engines[tier]
        backend = engine.storage_manager.storage_backends["LocalCPUBackend" if tier == "memory" else "LocalDiskBackend"]
        keys = self._keys(engine)
        start = time.perf_counter()
        self.scratch.copy_(self.kv)  # this process's limit: one plain copy of the same bytes
        figures = {"copy_s": time.perf_counter() - start}
        figures |= self._connector_alone()
        start = time.perf_counter()
        engine.store(self.tokens, kv=self.kv)
        deadline = start + 300
        while not all(backend.contains(key) for key in keys):  # disk writes finish on LMCache's own thread
            if time.perf_counter() > deadline:
                raise RuntimeError(f"LMCache's {tier} backend did not take every chunk (see its warnings above)")
            time.sleep(0.0005)
        figures["store_s"] = time.perf_counter() - start
        if tier == "disk":
            start = time.perf_counter()
            fsync_files(self.dir)
            figures["fsync_s"] = time.perf_counter() - start
            figures["page_cache"] = drop_page_cache(self.dir)
        self.out.zero_()
        start = time.perf_counter()
        hit = engine.retrieve(self.tokens, out=self.out)
        figures["retrieve_s"] = time.perf_counter() - start
        figures["hit_tokens"] = int(hit.sum())
        figures["exact"] = bool(torch.equal(self.out, self.kv))
        for key in keys:  # the next round stores afresh
            engine.storage_manager.remove(key)
        figures["files_left"] = sum(1 for file in self.dir.rglob("*") if file.is_file())
        return figures

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        for name in ("bench-memory", "bench-disk"):
            LMCacheEngineBuilder.destroy(name)
        for file in sorted(self.dir.rglob("*"), reverse=True):
            file.unlink() if file.is_file() else file.rmdir()
        self.dir.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--chunk-size", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--rounds", type=int, required=True, help="how many rounds will be asked (sizes the disk)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--odirect", action="store_true", help="LMCache's use_odirect (off by default in LMCache)")
    args = ap.parse_args()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # LMCache's log lines and prints go to stderr; stdout carries the answers only
    side = Side(args)
    answers.write(json.dumps({"ready": True, "lmcache": version("lmcache"), "torch": torch.__version__,
                              "kv_sha256": kv_digest(side.kv)}) + "\n")
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("op") == "quit":
                break
            answers.write(json.dumps(side.round(request["tier"])) + "\n")
    finally:
        side.close()


if __name__ == "__main__":
    main()
