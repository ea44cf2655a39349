"""Codec calibration: which codec loads a prefix fastest from which tier on this machine, and what capacity
each one buys at what cost.

Two measurements, both against a limit measured in the same run:

* **codecs**: encode and decode GB/s (of uncompressed KV) of each codec on one thread and on every core (a
  thread pool; the codecs release the GIL), next to a plain copy of the same bytes, and each codec's ratio;
* **tiers**: for every configured tier and every codec, the chunks of ``sample_bytes`` of KV are stored
  through a ``KVCache`` whose only tier is that tier with that codec, then retrieved (best of ``reps``; the
  page cache dropped before each read when asked and allowed): load GB/s of KV, the real path a request
  takes, read and decode included.

The KV is synthetic with the statistics that matter to the codecs (Gaussian values, a few outlier key
channels, a heavy first token, stored in the spec's dtype). Calibration writes under a model name and salt
of its own and deletes what it wrote; a memory tier is built with room for the sample only.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvtier.base.layout import KVSpec
from kvtier.codecs import get_codec
from kvtier.codecs.base import decode_into
from kvtier.core.cache import KVCache
from kvtier.core.config import CacheConfig
from kvtier.tiers import Flushable, TierConfig

CODECS = ("raw", "lossless", "int8", "int4", "cachegen")
#: Llama-3-8B's KV shape: 128 KiB per token in bf16, a 32 MiB chunk of 256 tokens
DEFAULT_SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


@dataclass(frozen=True)
class CodecSpeed:
    codec: str
    ratio: float  #: KV bytes / payload bytes
    encode_gbs: float  #: one thread, GB/s of KV
    decode_gbs: float
    decode_all_cores_gbs: float


@dataclass(frozen=True)
class TierLoad:
    tier: str
    codec: str
    store_gbs: float  #: GB/s of KV through KVCache.store (encode + write)
    load_gbs: float  #: GB/s of KV through KVCache.retrieve (read + verify + decode + copy out)


@dataclass(frozen=True)
class Calibration:
    memcpy_gbs: float
    cores: int
    codecs: tuple[CodecSpeed, ...]
    loads: tuple[TierLoad, ...]

    def fastest(self, tier: str) -> TierLoad:
        """The codec that loads a prefix fastest from ``tier``."""
        return max((x for x in self.loads if x.tier == tier), key=lambda x: x.load_gbs)

    def load(self, tier: str, codec: str) -> TierLoad:
        return next(x for x in self.loads if x.tier == tier and x.codec == codec)

    def advice(self) -> list[str]:
        """One line per tier: the fastest codec, and what each denser codec costs in load speed there."""
        lines = []
        ratios = {c.codec: c.ratio for c in self.codecs}
        for tier in dict.fromkeys(x.tier for x in self.loads):
            best = self.fastest(tier)
            raw = self.load(tier, "raw").load_gbs if any(x.codec == "raw" for x in self.loads) else best.load_gbs
            denser = sorted((x for x in self.loads if x.tier == tier and ratios[x.codec] > 1.05),
                            key=lambda x: ratios[x.codec])
            cost = ", ".join(f"{x.codec} {ratios[x.codec]:.2f}x capacity at {x.load_gbs / raw:.2f}x raw's load speed"
                             for x in denser)
            lines.append(f"{tier}: {best.codec} loads fastest ({best.load_gbs:.2f} GB/s of KV, "
                         f"{best.load_gbs / raw:.2f}x raw); {cost or 'no denser codec measured'}")
        return lines

    def table(self) -> str:
        rows = ["| codec | ratio | encode GB/s | decode GB/s (1 thread) | decode GB/s "
                f"({self.cores} threads) | decode / memcpy |", "|---|---|---|---|---|---|"]
        for c in self.codecs:
            if c.decode_gbs > 10 * self.memcpy_gbs:  # decodes to a view of the payload (raw): nothing to time
                decode = "view | view | -"
            else:
                decode = f"{c.decode_gbs:.2f} | {c.decode_all_cores_gbs:.2f} | {c.decode_gbs / self.memcpy_gbs:.2f}"
            rows.append(f"| {c.codec} | {c.ratio:.2f} | {c.encode_gbs:.2f} | {decode} |")
        tiers = list(dict.fromkeys(x.tier for x in self.loads))
        codecs = list(dict.fromkeys(x.codec for x in self.loads))
        rows += ["", "load GB/s of KV (store GB/s) | " + " | ".join(tiers), "|---" * (len(tiers) + 1) + "|"]
        for codec in codecs:
            cells = [f"{self.load(t, codec).load_gbs:.2f} ({self.load(t, codec).store_gbs:.2f})" for t in tiers]
            rows.append(f"| {codec} | " + " | ".join(cells) + " |")
        return "\n".join(rows)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def synthetic_kv(spec: KVSpec, tokens: int, seed: int = 0) -> torch.Tensor:
    """Canonical KV ``[layers, 2, tokens, kv_heads, head_dim]`` shaped like real KV for the codecs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.num_layers, 2, tokens, spec.num_kv_heads, spec.head_dim, generator=gen)
    x[:, 0, :, :, : max(1, spec.head_dim // 32)] *= 12  # outlier key channels
    x[:, :, :1] *= 8  # an attention-sink-like first token
    return x.to(spec.dtype)


def timed(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None) -> list[float]:
    """Wall-clock seconds of ``reps`` calls of ``fn``; ``setup`` runs untimed before each (the benchmarks
    time with this too)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _best(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None) -> float:
    """Fastest of ``reps`` timed calls (on a shared machine interference only adds time)."""
    return min(timed(fn, reps, setup))


def measure_codec(name: str, chunks: Sequence[torch.Tensor], reps: int, pool: ThreadPoolExecutor) -> CodecSpeed:
    """Ratio, and encode / decode GB/s of KV on one thread and on ``pool``. Decodes go into reused tensors, as
    the retrieve pipeline decodes into the sink or a reused buffer (a fresh tensor per chunk would time the
    kernel faulting its pages in)."""
    codec = get_codec(name)
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    payloads = []
    for chunk in chunks:
        payload = codec.encode(chunk)
        buf = bytearray(payload.nbytes)
        payload.write_into(memoryview(buf))
        payloads.append(buf)

    def encode(chunk: torch.Tensor) -> None:
        payload = codec.encode(chunk)
        payload.write_into(memoryview(bytearray(payload.nbytes)))

    outs = [torch.zeros_like(c) for c in chunks]

    def decode(i: int) -> None:
        decode_into(codec, memoryview(payloads[i]), tuple(chunks[i].shape), chunks[i].dtype, outs[i])

    one = _best(lambda: [decode(i) for i in range(len(chunks))], reps)
    every = _best(lambda: list(pool.map(decode, range(len(chunks)))), reps)
    enc = _best(lambda: [encode(c) for c in chunks], reps)
    return CodecSpeed(name, nbytes / sum(map(len, payloads)), nbytes / enc / 1e9, nbytes / one / 1e9,
                      nbytes / every / 1e9)


def plain_copy_seconds(chunks: Sequence[torch.Tensor], reps: int) -> float:
    """Best seconds to copy ``chunks`` into tensors that already exist: the limit a decode is compared with."""
    outs = [torch.zeros_like(c) for c in chunks]
    return _best(lambda: [o.copy_(c) for o, c in zip(outs, chunks)], reps)


def _sized(cfg: TierConfig, sample_bytes: int, codec: str) -> TierConfig:
    """``cfg`` with ``codec``, and room for the sample only where a tier reserves its capacity up front."""
    changes: dict = {"codec": codec}
    capacity = getattr(cfg, "capacity_bytes", None)
    if capacity is not None:
        changes["capacity_bytes"] = min(capacity, 2 * sample_bytes + (64 << 20))
    return dataclasses.replace(cfg, **changes)


def measure_tier(cfg: TierConfig, name: str, codec: str, spec: KVSpec, chunk_tokens: int, kv: torch.Tensor,
                 reps: int, drop_caches: Callable[[], object] | None) -> TierLoad:
    """Store ``kv`` through a one-tier KVCache of ``cfg`` with ``codec``, retrieve it ``reps`` times, clean up."""
    config = CacheConfig(chunk_size=chunk_tokens, tiers=(_sized(cfg, kv.numel() * kv.element_size(), codec),))
    tokens = torch.randint(0, 1 << 30, (kv.shape[2],), generator=torch.Generator().manual_seed(7)).tolist()
    salt = secrets.token_bytes(16)  # nothing calibration writes can be mistaken for a real prefix
    nbytes = kv.numel() * kv.element_size()
    out = torch.empty_like(kv)
    with KVCache(spec, model="kvtier-calibrate", config=config) as cache:
        tier = cache.tiers[0]
        start = time.perf_counter()
        _store_all(cache, tokens, kv, salt)
        store_s = time.perf_counter() - start
        try:
            load_s = _best(lambda: _retrieve_all(cache, tokens, out, salt), reps, drop_caches)
        finally:
            tier.delete(cache.keys(tokens, salt=salt))
    return TierLoad(name, codec, nbytes / store_s / 1e9, nbytes / load_s / 1e9)


def _store_all(cache: KVCache, tokens: list[int], kv: torch.Tensor, salt: bytes, deadline_s: float = 120) -> None:
    """Store until every chunk is in (a tier with a write queue may turn some away while it is full)."""
    tier = cache.tiers[0]
    until = time.monotonic() + deadline_s
    while True:
        cache.store(tokens, kv, salt=salt)
        if isinstance(tier, Flushable):
            tier.flush()
        if cache.lookup(tokens, salt=salt) == len(tokens):
            return
        if time.monotonic() > until:
            raise TimeoutError(f"tier {tier.name} did not take the calibration sample within {deadline_s:.0f} s")
        time.sleep(0.01)


def _retrieve_all(cache: KVCache, tokens: list[int], out: torch.Tensor, salt: bytes) -> None:
    _, n = cache.retrieve(tokens, out, salt=salt)
    if n != len(tokens):
        raise RuntimeError(f"calibration read back {n} of {len(tokens)} tokens from {cache.tiers[0].name}")


def calibrate(tiers: Sequence[tuple[str, TierConfig]], *, spec: KVSpec = DEFAULT_SPEC, chunk_tokens: int = 256,
              sample_bytes: int = 256 << 20, codecs: Sequence[str] = CODECS, reps: int = 3,
              drop_caches: Callable[[], object] | None = None,
              progress: Callable[[str], None] = lambda _msg: None) -> Calibration:
    """Measure every codec, then every (tier, codec) pair; ``tiers`` are ``(name, config)`` pairs."""
    for name in codecs:
        get_codec(name)  # an unknown name is a ConfigError now, not after minutes of measuring
    chunk_bytes = spec.bytes_per_token * chunk_tokens
    n_chunks = max(1, sample_bytes // chunk_bytes)
    kv = synthetic_kv(spec, n_chunks * chunk_tokens)
    chunks = [kv[:, :, i * chunk_tokens : (i + 1) * chunk_tokens].contiguous() for i in range(n_chunks)]
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread means one thread: torch's intra-op pool would blur the figures
    try:
        memcpy = plain_copy_seconds(chunks, reps)
        with ThreadPoolExecutor(cores) as pool:
            speeds = []
            for name in codecs:
                progress(f"codec {name}")
                speeds.append(measure_codec(name, chunks, reps, pool))
        loads = []
        for tier_name, cfg in tiers:
            for name in codecs:
                progress(f"tier {tier_name}, codec {name}")
                loads.append(measure_tier(cfg, tier_name, name, spec, chunk_tokens, kv, reps, drop_caches))
    finally:
        torch.set_num_threads(threads)
    nbytes = n_chunks * chunk_bytes
    return Calibration(nbytes / memcpy / 1e9, cores, tuple(speeds), tuple(loads))
