"""State snapshots in a KVCache's tiers: store, find and load them next to the attention KV chunks.

A snapshot at boundary ``k`` is one verified blob per state kind (see state.py), stored under
``state_key(h_k, kind)`` in the same tiers, with the same codecs (exact ones only), the same write-through /
write-back rules and the same promotion of hits from slower tiers. Blobs record chunk ``k``'s token ids, so a
read checks them like a KV chunk's.

Contracts:

* ``usable(keys, n)`` is the longest prefix a caller can restore: the largest boundary ``k <= n`` at which
  every state kind is present (``n`` being how many leading KV chunks are present). No side effects.
* ``restore`` returns the longest prefix whose attention KV and snapshot (every kind) all arrive verified,
  copied out of the tiers: a missing snapshot is a miss; one that does not verify (corrupt, wrong shape) is
  deleted, counted in ``kvtier_corrupt_chunks_total`` and is a miss too, and the next lower boundary with a
  snapshot is tried. Never a partial or unverified state, never KV without its state.
* ``store`` never raises for tier failures: they are logged, counted and the snapshot is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.base.errors import BlobError, ConfigError, InvalidArgument, KVTierError
from kvtier.base.keys import ChunkHash
from kvtier.base.metrics import Metrics
from kvtier.base.state import ModelStateSpec, StateKind, StateSpec, state_key
from kvtier.codecs.blob import decode_blob, encode_blob
from kvtier.core.config import CacheConfig
from kvtier.tiers import Tier, WriteMode, locate_keys

log = logging.getLogger(__name__)

#: One snapshot: a tensor per state kind, ``[slots, *shape]`` as the model's StateSpec says.
Snapshot = Mapping[StateKind, torch.Tensor]
TierFailed = Callable[[Tier, str, KVTierError], None]
#: Loads the attention KV of at most ``n`` leading tokens: ``(canonical tensor or None, tokens loaded)``.
LoadKV = Callable[[int], tuple[torch.Tensor | None, int]]


@dataclass
class PrefixState:
    """What a stateful prefix hit restores: ``tokens`` leading tokens (a multiple of the chunk size, 0 for a
    miss), their attention KV (canonical, None for models without attention layers or on a miss) and the
    snapshot of every state kind at that boundary."""

    tokens: int = 0
    kv: torch.Tensor | None = None
    states: dict[StateKind, torch.Tensor] = field(default_factory=dict)


class NoStates:
    """The state store of a model without state kinds: every KV prefix is usable, nothing else is stored."""

    def usable(self, keys: Sequence[ChunkHash], n: int) -> int:
        return n

    def restore(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, n_kv: int, load_kv: LoadKV | None) -> PrefixState:
        raise ConfigError("this model keeps no state beyond attention KV: use retrieve()")

    def store(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, snapshots: Mapping[int, Snapshot]) -> int:
        raise ConfigError("this model keeps no state beyond attention KV: use store()")


class StateSnapshots:
    """Snapshot storage for one KVCache. Keeps no state besides the tiers it shares with the cache."""

    def __init__(self, spec: ModelStateSpec, config: CacheConfig, tiers: Sequence[Tier], metrics: Metrics,
                 tier_failed: TierFailed) -> None:
        for tier in tiers:
            if not tier.codec.exact:
                raise ConfigError(f"tier {tier.name}: codec {tier.codec.name!r} is lossy, and SSM state must be "
                                  "stored exactly (errors in a recurrent state compound): use raw or lossless")
        self.specs: dict[StateKind, StateSpec] = {s.kind: s for s in spec.states}
        self.chunk_size = config.chunk_size
        self._tiers = list(tiers)
        self._writes = [i == 0 or cfg.write is WriteMode.THROUGH for i, cfg in enumerate(config.tiers)]
        self._metrics = metrics
        self._tier_failed = tier_failed

    # -- finding -------------------------------------------------------------------------------------------
    def usable(self, keys: Sequence[ChunkHash], n: int) -> int:
        """The largest boundary ``k <= n`` (in chunks) with every state kind stored, or 0."""
        found = self._boundaries_with_state(keys, n)
        return found[0] if found else 0

    def _boundaries_with_state(self, keys: Sequence[ChunkHash], n: int) -> list[int]:
        """Boundaries ``k <= n`` at which every state kind is stored in some tier, largest first."""
        wanted = [state_key(keys[k - 1], kind) for k in range(1, n + 1) for kind in self.specs]
        where = self._locate(wanted)
        per = len(self.specs)
        return [k for k in range(n, 0, -1) if all(t is not None for t in where[(k - 1) * per : k * per])]

    def _locate(self, keys: Sequence[ChunkHash]) -> list[int | None]:
        """For each key, the index of the fastest tier holding it (None where no tier does)."""
        return locate_keys(self._tiers, keys, self._tier_failed)

    # -- loading -------------------------------------------------------------------------------------------
    def restore(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, n_kv: int, load_kv: LoadKV | None) -> PrefixState:
        """The longest prefix within the first ``n_kv`` chunks whose KV (through ``load_kv``; None for models
        without attention) and snapshot both arrive intact. A boundary whose snapshot fails falls back to the
        next lower one with a snapshot; KV that arrives only in part caps the boundary."""
        candidates = self._boundaries_with_state(keys, n_kv)
        if not candidates:
            return PrefixState()
        size = self.chunk_size
        kv, intact = None, candidates[0]
        if load_kv is not None:
            kv, loaded = load_kv(candidates[0] * size)
            intact = loaded // size
        for boundary in candidates:
            if boundary > intact:
                continue
            states = self._load(keys, boundary, token_ids)
            if states is not None:
                return PrefixState(boundary * size, None if kv is None else kv[:, :, : boundary * size], states)
        return PrefixState()

    def _load(self, keys: Sequence[ChunkHash], boundary: int, token_ids: np.ndarray) -> dict[StateKind, torch.Tensor] | None:
        """Every kind's snapshot at ``boundary`` (chunks; ``keys`` are the request's chunk keys), or None."""
        tokens = token_ids[(boundary - 1) * self.chunk_size : boundary * self.chunk_size]
        out: dict[StateKind, torch.Tensor] = {}
        for kind, spec in self.specs.items():
            tensor = self._load_one(state_key(keys[boundary - 1], kind), tokens, spec)
            if tensor is None:
                return None
            out[kind] = tensor
        return out

    def _load_one(self, key: ChunkHash, tokens: np.ndarray, spec: StateSpec) -> torch.Tensor | None:
        """The verified snapshot of one kind from the fastest tier holding it (promoted upwards), or None."""
        where = self._locate([key])[0]
        if where is None:
            return None
        tier = self._tiers[where]
        tensor, corrupt = None, False
        try:
            with tier.get([key]) as (blob,):
                if blob is not None:
                    tensor = self._decode(tier, key, blob, tokens, spec)
                    corrupt = tensor is None
                    self._metrics.inc("kvtier_read_bytes_total", blob.nbytes, tier=tier.name)
        except KVTierError as exc:
            self._tier_failed(tier, "get", exc)
            return None
        if corrupt:
            self._delete(tier, key)
        if tensor is None:
            return None
        self._metrics.inc("kvtier_state_snapshots_loaded_total", tier=tier.name, kind=spec.kind.value)
        for faster in self._tiers[:where]:
            if self._put(faster, [(key, tokens, tensor)], "promote"):
                self._metrics.inc("kvtier_promotions_total", tier=faster.name)
        return tensor

    def _decode(self, tier: Tier, key: ChunkHash, blob: memoryview, tokens: np.ndarray,
                spec: StateSpec) -> torch.Tensor | None:
        """A copy of the snapshot in ``blob`` if it verifies and has the spec's shape and dtype, else None."""
        try:
            tensor = decode_blob(blob, key, tokens, codec=tier.codec, verify=tier.verifies)
            spec.check(tensor)
        except (BlobError, InvalidArgument) as exc:
            self._metrics.inc("kvtier_corrupt_chunks_total", tier=tier.name)
            log.warning("tier %s: %s snapshot %s is a miss: %s", tier.name, spec.kind.value, key.hex()[:16], exc)
            return None
        return tensor.clone()  # the blob is valid only inside the tier's get()

    # -- storing -------------------------------------------------------------------------------------------
    def store(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, snapshots: Mapping[int, Snapshot]) -> int:
        """Store ``{boundary: snapshot}`` (boundaries in chunks, ``keys`` the request's chunk keys) into the
        first tier and every write-through tier. Returns how many boundaries some tier newly stored."""
        size = self.chunk_size
        items: list[tuple[ChunkHash, np.ndarray, torch.Tensor]] = []
        owners: list[int] = []
        for boundary, snapshot in sorted(snapshots.items()):
            if not 0 < boundary <= len(keys) or set(snapshot) != set(self.specs):
                raise InvalidArgument(f"snapshot at boundary {boundary} must hold {sorted(k.value for k in self.specs)}"
                                  f" and lie within the {len(keys)} full chunks")
            for kind, tensor in snapshot.items():
                self.specs[kind].check(tensor)
                items.append((state_key(keys[boundary - 1], kind), token_ids[(boundary - 1) * size : boundary * size],
                              tensor))
                owners.append(boundary)
        stored: set[int] = set()
        for tier, writes in zip(self._tiers, self._writes):
            if not writes:
                continue
            done = self._put(tier, items, "put")
            if done:
                self._metrics.inc("kvtier_state_snapshots_stored_total", len(done), tier=tier.name)
            stored.update(owners[i] for i in done)
        return len(stored)

    def _put(self, tier: Tier, items: Sequence[tuple[ChunkHash, np.ndarray, torch.Tensor]], op: str) -> list[int]:
        """Write the items ``tier`` lacks; return the indices it newly stored."""
        try:
            missing = [i for i, present in enumerate(tier.contains([key for key, _, _ in items])) if not present]
            if not missing:
                return []
            payloads = [(items[i][0], encode_blob(items[i][0], items[i][1], tier.codec, items[i][2],
                                                  seal=tier.verifies)) for i in missing]
            stored = tier.put(payloads)
        except KVTierError as exc:
            self._tier_failed(tier, op, exc)
            return []
        return [i for i, ok in zip(missing, stored) if ok]

    def _delete(self, tier: Tier, key: ChunkHash) -> None:
        try:
            tier.delete([key])
        except KVTierError as exc:
            self._tier_failed(tier, "delete", exc)
