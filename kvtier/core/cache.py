"""KVCache: the chain of tiers behind three calls, lookup / store / retrieve.

* ``lookup(tokens)`` -> how many leading tokens are cached (a multiple of the chunk size), with the chunks
  allowed to sit in different tiers. Eviction order is untouched; the chunks found count as a sighting for the
  tiers' admission policies (kvtier.policy.admission), as a retrieve's do.
* ``store(tokens, kv)`` writes the full chunks of ``kv`` that tiers lack: to the first tier and to every tier
  in write-through mode; write-back tiers receive chunks when the tier above evicts them (the rules of the
  chain of tiers, chain.py).
* ``retrieve(tokens)`` loads the longest cached prefix, verifying every chunk (token ids always; checksum
  for tiers whose bytes left the process). A chunk that fails is deleted, counted and ends the prefix: the
  engine recomputes from there. Hits in slower tiers are promoted into the faster ones.

Failures of a tier (``KVTierError``) become misses or skipped stores plus a metric; they never propagate.

Models with SSM layers (a ``ModelStateSpec`` instead of a ``KVSpec``) also keep state snapshots at chunk
boundaries (``store_states`` / ``retrieve_states``, logic in snapshots.py); their ``lookup`` counts only
prefixes whose every kind is cached: the KV of each chunk up to a boundary and the snapshot at it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from kvtier.base.errors import ConfigError, InvalidArgument, KVTierError
from kvtier.base.keys import NO_EXTRAS, ChunkHash, ExtraKeys, Namespace, Tokens, token_array
from kvtier.base.layout import KVSpec
from kvtier.base.metrics import Metrics
from kvtier.base.state import ModelStateSpec, StateKind
from kvtier.core.chain import TierChain
from kvtier.core.config import CacheConfig
from kvtier.core.control import CacheControl
from kvtier.core.events import CacheEvents
from kvtier.core.jobs import PipelineTuning, StoreJob, source_device
from kvtier.core.metrics import (
    HIT_TOKENS,
    LOOKUP_SECONDS,
    LOOKUP_TOKENS,
    LOOKUPS,
    MISS_TOKENS,
    RETRIEVE_SECONDS,
    STORE_SECONDS,
)
from kvtier.core.pipeline import Pipeline
from kvtier.core.snapshots import NoStates, PrefixState, Snapshot, StateSnapshots
from kvtier.policy.admission import make_admission
from kvtier.tiers import Tier, TierContext
from kvtier.tiers.control import Tags, expires_at, tenant_tag

log = logging.getLogger(__name__)


class KVSource(Protocol):
    """Where ``store`` reads KV from, one chunk at a time (engine integrations adapt their layout here).

    Optional: ``device``, where the chunks are (``cpu`` when absent). A store from a GPU first waits for the
    work queued on the caller's current stream, and bounds the chunks it holds there at once
    (``PipelineTuning.device_window_bytes``)."""

    def chunk(self, start: int, end: int) -> torch.Tensor:
        """Canonical KV of tokens ``[start, end)``: ``[layers, 2, end - start, kv_heads, head_dim]``, any strides,
        on the CPU or on a GPU (then ready to read from any stream: kvtier copies it on its own, ``native.gpu``)."""


class KVSink(Protocol):
    """Where ``retrieve`` writes KV to, one chunk at a time.

    Optional: ``destination(start, end) -> torch.Tensor | None``, a CPU tensor (canonical shape for tokens
    ``[start, end)``, any strides) that the retrieve decodes straight into instead of calling ``write``: no
    temporary chunk and no extra copy. The sink then promises that disjoint token ranges may be written from
    several threads at once. A chunk that fails after verification may leave partial bytes there; as with
    ``write``, only the prefix ``retrieve`` returns is valid.

    Optional: ``settle()``, for a sink whose ``write`` may go on reading ``chunk`` after it returns (an
    asynchronous copy to a GPU straight out of a tier's pinned memory). ``chunk`` then stays valid until the
    next ``settle()`` returns: the retrieve calls it before it reuses or releases the memory of any chunk it
    has written (after each write of a reused decode buffer, and before a window's tier reads are released).
    """

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        """Copy canonical KV of tokens ``[start, end)`` out of ``chunk`` (valid only during the call, or until
        ``settle()`` for a sink that has it)."""


class TensorSource:
    """A canonical ``[L, 2, T, H, D]`` tensor as a KVSource."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.device = kv.device

    def chunk(self, start: int, end: int) -> torch.Tensor:
        return self.kv[:, :, start:end]


class TensorSink:
    """A canonical ``[L, 2, T, H, D]`` tensor as a KVSink."""

    #: writes of disjoint token ranges may run in parallel (the retrieve pipeline's workers)
    concurrent_writes = True

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def write(self, start: int, end: int, chunk: torch.Tensor) -> None:
        self.out[:, :, start:end].copy_(chunk)

    def destination(self, start: int, end: int) -> torch.Tensor | None:
        """The token range itself, where ``out`` is on the CPU (codecs decode into it)."""
        return self.out[:, :, start:end] if self.out.device.type == "cpu" else None


def _tier_names(kinds: Sequence[str]) -> list[str]:
    names: list[str] = []
    for kind in kinds:
        name, n = kind, 2
        while name in names:
            name, n = f"{kind}{n}", n + 1
        names.append(name)
    return names


class KVCache:
    """Tiered prefix KV cache for one model (one namespace apart from per-call tenant salts).

    ``tuning`` sets how the pipeline cuts and overlaps its windows (defaults suit any machine). ``chain`` is the
    chain of tiers, which segment caches (segments.py) share. ``clock`` (seconds, wall-clock time by default) is
    what store TTLs count on and the tiers expire entries by, and what the tiers' admission rate caps refill by
    (tests and the simulator inject their own). ``control`` pins, clears and looks up per tier
    (kvtier.core.control). Thread-safe: tiers lock their own state and the cache keeps none besides them.
    """

    def __init__(
        self,
        spec: KVSpec | ModelStateSpec,
        model: str,
        config: CacheConfig | None = None,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        adapter: str = "",
        metrics: Metrics | None = None,
        tuning: PipelineTuning | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config if config is not None else CacheConfig()
        self.model_spec = ModelStateSpec.of(spec)
        self.spec = self.model_spec.attention  #: None for models without attention layers (pure SSM)
        self.chunk_size = self.config.chunk_size
        self.namespace = Namespace(model, spec, self.chunk_size, tp_rank, tp_size, adapter)
        self.metrics = metrics if metrics is not None else Metrics()
        self.events = CacheEvents()  #: chunks stored / removed per tier (kvtier.events)
        self._pipeline = Pipeline(self.spec, self.chunk_size, self.metrics, tuning)  # pure SSM: moves no KV
        names = _tier_names([cfg.kind for cfg in self.config.tiers])
        self.clock = clock  #: what store TTLs and the tiers' expiries count on (seconds)
        tenants = {tenant_tag(salt): name for name, salt in self.config.tenant_salts().items()}
        self.tiers: list[Tier] = []
        try:
            for cfg, name in zip(self.config.tiers, names):
                self.tiers.append(cfg.build(TierContext(spec, self.metrics, name, tp_rank, tp_size,
                                                        self.namespace.root.hex()[:16], tenants, clock)))
            admission = [make_admission(cfg.admission_settings(first=t == 0), clock)
                         for t, cfg in enumerate(self.config.tiers)]
            self.chain = TierChain(self.tiers, [cfg.write for cfg in self.config.tiers], self.metrics, self.events,
                                   self._pipeline, admission)
            self._states = (StateSnapshots(self.model_spec, self.chunk_size, self.chain)
                            if self.model_spec.states else NoStates())
            self.control = CacheControl(self)  #: pins, clears, per-tier lookup and usage (kvtier.core.control)
        except BaseException:
            self.close()
            raise

    # -- public API ----------------------------------------------------------------------------------------
    def keys(self, tokens: Tokens, *, salt: bytes = b"", extras: ExtraKeys = NO_EXTRAS) -> list[ChunkHash]:
        """Chunk keys of the full chunks of ``tokens`` in this cache's namespace (with ``salt``), each with the
        ``extras`` overlapping it folded in (kvtier.base.keys: every input beside the tokens that changes KV)."""
        return self.namespace.with_salt(salt).chunk_hashes(tokens, extras)

    def lookup(self, tokens: Tokens, *, salt: bytes = b"", extras: ExtraKeys = NO_EXTRAS) -> int:
        """Number of leading tokens of ``tokens`` that retrieve can load now (a multiple of chunk_size). The chunks
        found are a sighting for admission (a reuse); nothing else changes."""
        with self.metrics.timer(LOOKUP_SECONDS):
            keys = self.keys(tokens, salt=salt, extras=extras)
            n = self._states.usable(keys, self._kv_prefix(keys))
            self.chain.sighted(keys[:n])
        self.metrics.inc(LOOKUPS)
        self.metrics.inc(LOOKUP_TOKENS, len(keys) * self.chunk_size)
        return n * self.chunk_size

    def store(self, tokens: Tokens, kv: torch.Tensor | KVSource, *, salt: bytes = b"",
              ttl_s: float | None = None, extras: ExtraKeys = NO_EXTRAS) -> int:
        """Store the full chunks of ``tokens`` whose KV ``kv`` holds (canonical tensor or KVSource).

        The new entries are owned by the tenant ``salt`` names (its share and clears: kvtier.core.control) and,
        with ``ttl_s``, expire that many seconds from now (misses from then on, reclaimed; a tier that cannot
        expire entries is not written). ``extras``: as for ``keys``. Returns the number of tokens newly written
        to at least one tier. Never raises for tier failures; InvalidArgument for a negative or non-finite
        ``ttl_s``.
        """
        with self.metrics.timer(STORE_SECONDS):
            self._require_attention()
            token_ids = token_array(tokens)
            keys = self.keys(token_ids, salt=salt, extras=extras)
            if isinstance(kv, torch.Tensor):
                if kv.dim() != 5 or kv.shape[2] < len(keys) * self.chunk_size:
                    raise InvalidArgument(f"kv {tuple(kv.shape)} does not cover {len(keys)} chunks")
                self.spec.check(kv[:, :, :0], 0)
                source: KVSource = TensorSource(kv)
            else:
                source = kv
            written = self.store_keyed(keys, token_ids, source, salt=salt, ttl_s=ttl_s, extras=extras)
            return sum(written) * self.chunk_size

    def store_keyed(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, source: KVSource, *, salt: bytes = b"",
                    ttl_s: float | None = None, extras: ExtraKeys = NO_EXTRAS, ttl_required: bool = True) -> list[bool]:
        """``store`` under keys the caller derived itself (an engine's own chained page hashes mapped into this
        namespace), chunk ``i`` being tokens ``[i * chunk_size, (i + 1) * chunk_size)`` of ``source`` and of
        ``token_ids`` (recorded in, and checked on every read of, its blob). True per chunk newly written to at
        least one tier. ``salt``: the tenant the keys were derived for (the entries' owner); ``ttl_s`` as for
        ``store``; ``extras``: those the keys were derived with (reported with the chunks' stored events);
        ``ttl_required=False``: a tier that cannot expire entries stores them without expiry instead of being
        skipped (kvtier.tiers.control.Tags). Never raises for tier failures."""
        tags = Tags(tenant_tag(salt), expires_at(ttl_s, self.clock()), ttl_required)
        device = source_device(source)
        if device.type == "cuda":  # kvtier copies on its own streams: what the caller queued must be done
            torch.cuda.current_stream(device).synchronize()
        written = self.chain.store_chunks(StoreJob(keys, token_ids, source, tags, extras))
        self.chain.order_chain(keys)
        return written

    def retrieve(
        self,
        tokens: Tokens,
        out: torch.Tensor | KVSink | None = None,
        *,
        salt: bytes = b"",
        max_tokens: int | None = None,
        extras: ExtraKeys = NO_EXTRAS,
    ) -> tuple[torch.Tensor | None, int]:
        """Load the longest cached prefix of ``tokens`` (at most ``max_tokens``).

        ``out`` is a canonical tensor with room for the prefix, or a KVSink; when omitted a tensor is
        allocated. Returns ``(tensor or None for a sink, n_tokens)``; only the first ``n_tokens`` are valid.
        ``extras``: as for ``keys``.
        """
        with self.metrics.timer(RETRIEVE_SECONDS):
            self._require_attention()
            token_ids = token_array(tokens)
            keys = self.keys(token_ids, salt=salt, extras=extras)
            if max_tokens is not None:
                keys = keys[: max(max_tokens, 0) // self.chunk_size]
            where = self.chain.locate(keys)
            n = self.chain.prefix(where)
            if n == 0:
                self.metrics.inc(MISS_TOKENS, len(keys) * self.chunk_size)
                return (None if out is not None and not isinstance(out, torch.Tensor) else out), 0
            tensor: torch.Tensor | None
            if out is None:
                tensor = self.spec.empty(n * self.chunk_size)
                sink: KVSink = TensorSink(tensor)
            elif isinstance(out, torch.Tensor):
                if out.dim() != 5 or out.shape[2] < n * self.chunk_size:
                    raise InvalidArgument(f"out {tuple(out.shape)} has no room for {n * self.chunk_size} tokens")
                self.spec.check(out[:, :, :0], 0)
                tensor, sink = out, TensorSink(out)
            else:
                tensor, sink = None, out
            good = self._load_prefix(keys, where, token_ids, sink, salt)
        return tensor, good * self.chunk_size

    def retrieve_keyed(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, sink: KVSink, *,
                       salt: bytes = b"") -> int:
        """``retrieve`` under keys the caller derived itself (see ``store_keyed``) into ``sink``: returns how many
        leading chunks of ``keys`` arrived verified; ``salt``: the tenant the keys were derived for (the owner of
        what a hit promotes). Never raises for tier failures."""
        with self.metrics.timer(RETRIEVE_SECONDS):
            return self._load_prefix(keys, self.chain.locate(keys), token_ids, sink, salt)

    def locate(self, keys: Sequence[ChunkHash]) -> list[int | None]:
        """For each key, the index of the fastest tier holding it (None where no tier does; a prefix ends at the
        first None). No side effects: what a router or a simulator asks before choosing where a request goes."""
        return self.chain.locate(keys)

    # -- state beyond attention KV (SSM layers; see kvtier.base.state) ---------------------------------------------
    def store_states(self, tokens: Tokens, snapshots: dict[int, Snapshot], *, salt: bytes = b"",
                     extras: ExtraKeys = NO_EXTRAS) -> int:
        """Store state snapshots ``{k: {kind: tensor}}``, each taken after the first ``k`` full chunks of
        ``tokens``; store their KV chunks with ``store``. Returns how many boundaries were newly stored.
        ``extras``: as for ``keys``."""
        token_ids = token_array(tokens)
        return self._states.store(self.keys(token_ids, salt=salt, extras=extras), token_ids, snapshots)

    def retrieve_snapshot(self, keys: Sequence[ChunkHash], boundary: int,
                          token_ids: np.ndarray) -> dict[StateKind, torch.Tensor] | None:
        """Every state kind's snapshot at ``boundary`` (in chunks) of the chain ``keys`` (from ``keys``, whose
        tokens ``token_ids`` cover that boundary), verified and copied out of the tiers; None if any kind is
        missing or fails verification (a miss: the failed blob is deleted and counted). Loads no KV."""
        with self.metrics.timer(RETRIEVE_SECONDS):
            return self._states.load(keys, boundary, token_ids)

    def retrieve_states(self, tokens: Tokens, *, salt: bytes = b"", max_tokens: int | None = None) -> PrefixState:
        """Restore the longest prefix of ``tokens`` (at most ``max_tokens``) whose attention KV and state
        snapshot are all cached and verify: a hit at boundary ``k`` needs the KV of chunks ``1..k`` and the
        snapshot at ``k``. A miss is ``PrefixState()`` (0 tokens)."""
        with self.metrics.timer(RETRIEVE_SECONDS):
            token_ids = token_array(tokens)
            limit = len(token_ids) if max_tokens is None else max(max_tokens, 0)
            keys = self.keys(token_ids, salt=salt)[: limit // self.chunk_size]
            load_kv = (None if self.spec is None else
                       lambda n: self.retrieve(token_ids, salt=salt, max_tokens=n))
            return self._states.restore(keys, token_ids, self._kv_prefix(keys), load_kv)

    def close(self) -> None:
        self._pipeline.close()
        for tier in self.tiers:
            try:
                tier.close()
            except KVTierError as exc:
                log.warning("closing tier %s: %s", tier.name, exc)

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------------------
    def _kv_prefix(self, keys: Sequence[ChunkHash]) -> int:
        """Leading chunks whose KV some tier holds; all of them for models without attention layers."""
        return self.chain.prefix(self.chain.locate(keys)) if self.spec is not None else len(keys)

    def _require_attention(self) -> None:
        if self.spec is None:
            raise ConfigError("this model has no attention layers: use store_states / retrieve_states")

    def _load_prefix(self, keys: Sequence[ChunkHash], where: Sequence[int | None], token_ids: np.ndarray,
                     sink: KVSink, salt: bytes = b"") -> int:
        """Load the located prefix of ``keys`` into ``sink``, count hits per tier and the misses; return how many
        leading chunks arrived verified. Promoted chunks the slower tier records no owner for are ``salt``'s."""
        n = self.chain.prefix(where)
        good = 0
        self.chain.sighted(keys[:n])  # found: a sighting for admission (before the load promotes them)
        if n:
            ok = self.chain.load_chunks(keys[:n], where[:n], token_ids, sink, tenant_tag(salt))
            good = self.chain.prefix([t if hit else None for t, hit in zip(where, ok)])
            for t, tier in enumerate(self.tiers):
                hits = sum(1 for i in range(good) if where[i] == t)
                if hits:
                    self.metrics.inc(HIT_TOKENS, hits * self.chunk_size, tier=tier.name)
            self.chain.order_chain(keys[:good])
        self.metrics.inc(MISS_TOKENS, (len(keys) - good) * self.chunk_size)
        return good
