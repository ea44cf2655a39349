"""State snapshots in a KVCache's tiers: store, find and load them next to the attention KV chunks.

A snapshot at boundary ``k`` is one verified blob per state kind (see state.py), stored under
``state_key(h_k, kind)`` in the same tiers through the cache's TierChain (chain.py): the same codecs (exact ones
only), the same write-through / write-back rules, the same promotion of hits from slower tiers, deletion of what
fails verification and events (``EntryKind.SNAPSHOT``). Blobs record chunk ``k``'s token ids, so a read checks
them like a KV chunk's.

Contracts:

* ``usable(keys, n)`` is the longest prefix a caller can restore: the largest boundary ``k <= n`` at which
  every state kind is present (``n`` being how many leading KV chunks are present). No side effects.
* ``restore`` returns the longest prefix whose attention KV and snapshot (every kind) all arrive verified,
  copied out of the tiers: a missing snapshot is a miss; one that does not verify (corrupt, wrong shape) is
  deleted, counted in ``kvtier_corrupt_chunks_total`` and looked for in the slower tiers; found nowhere, it is a
  miss too, and the next lower boundary with a snapshot is tried. Never a partial or unverified state, never KV
  without its state.
* ``store`` never raises for tier failures: they are logged, counted and the snapshot is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.base.errors import BlobError, ConfigError, InvalidArgument
from kvtier.base.keys import ChunkHash
from kvtier.base.state import ModelStateSpec, StateKind, StateSpec, state_key
from kvtier.codecs.blob import decode_blob
from kvtier.core.chain import TierChain
from kvtier.core.events import EntryKind
from kvtier.core.jobs import Entry
from kvtier.core.metrics import SNAPSHOTS_LOADED, SNAPSHOTS_STORED
from kvtier.tiers import Tier

#: One snapshot: a tensor per state kind, ``[slots, *shape]`` as the model's StateSpec says.
Snapshot = Mapping[StateKind, torch.Tensor]
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

    def restore(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, n_kv: int,
                load_kv: LoadKV | None) -> PrefixState:
        raise ConfigError("this model keeps no state beyond attention KV: use retrieve()")

    def store(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, snapshots: Mapping[int, Snapshot]) -> int:
        raise ConfigError("this model keeps no state beyond attention KV: use store()")

    def load(self, keys: Sequence[ChunkHash], boundary: int,
             token_ids: np.ndarray) -> dict[StateKind, torch.Tensor] | None:
        raise ConfigError("this model keeps no state beyond attention KV: use retrieve()")


class StateSnapshots:
    """Snapshot storage for one KVCache, in its chain of tiers. Keeps no state besides the tiers."""

    def __init__(self, spec: ModelStateSpec, chunk_size: int, chain: TierChain) -> None:
        for tier in chain.tiers:
            if not tier.codec.exact:
                raise ConfigError(f"tier {tier.name}: codec {tier.codec.name!r} is lossy, and SSM state must be "
                                  "stored exactly (errors in a recurrent state compound): use raw or lossless")
        self.specs: dict[StateKind, StateSpec] = {s.kind: s for s in spec.states}
        self.chunk_size = chunk_size
        self._chain = chain
        self._metrics = chain.metrics

    # -- finding -------------------------------------------------------------------------------------------
    def usable(self, keys: Sequence[ChunkHash], n: int) -> int:
        """The largest boundary ``k <= n`` (in chunks) with every state kind stored, or 0."""
        found = self._boundaries_with_state(keys, n)
        return found[0] if found else 0

    def _boundaries_with_state(self, keys: Sequence[ChunkHash], n: int) -> list[int]:
        """Boundaries ``k <= n`` at which every state kind is stored in some tier, largest first."""
        wanted = [state_key(keys[k - 1], kind) for k in range(1, n + 1) for kind in self.specs]
        where = self._chain.locate(wanted)
        per = len(self.specs)
        return [k for k in range(n, 0, -1) if all(t is not None for t in where[(k - 1) * per : k * per])]

    # -- loading -------------------------------------------------------------------------------------------
    def restore(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, n_kv: int,
                load_kv: LoadKV | None) -> PrefixState:
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
            states = self.load(keys, boundary, token_ids)
            if states is not None:
                return PrefixState(boundary * size, None if kv is None else kv[:, :, : boundary * size], states)
        return PrefixState()

    def load(self, keys: Sequence[ChunkHash], boundary: int,
              token_ids: np.ndarray) -> dict[StateKind, torch.Tensor] | None:
        """Every kind's verified snapshot at ``boundary`` (chunks; ``keys`` are the request's chunk keys), or None."""
        tokens = token_ids[(boundary - 1) * self.chunk_size : boundary * self.chunk_size]
        by_key = {state_key(keys[boundary - 1], kind): kind for kind in self.specs}
        found = self._chain.read(dict.fromkeys(by_key, tokens), lambda tier, key, blob, ids: self._decode(
            tier, key, blob, ids, self.specs[by_key[key]]), EntryKind.SNAPSHOT)
        if len(found) < len(by_key):
            return None
        for key, (_, t) in found.items():
            self._metrics.inc(SNAPSHOTS_LOADED, tier=self._chain.tiers[t].name,
                              kind=by_key[key].value)
        return {by_key[key]: tensor for key, (tensor, _) in found.items()}

    @staticmethod
    def _decode(tier: Tier, key: ChunkHash, blob: memoryview, tokens: np.ndarray, spec: StateSpec) -> torch.Tensor:
        """A copy of the snapshot in ``blob``; BlobError unless it verifies and has ``spec``'s shape and dtype."""
        tensor = decode_blob(blob, key, tokens, codec=tier.codec, verify=tier.verifies)
        try:
            spec.check(tensor)
        except InvalidArgument as exc:
            raise BlobError(f"{spec.kind.value} snapshot of another shape: {exc}") from None
        return tensor.clone()  # the blob is valid only inside the tier's get()

    # -- storing -------------------------------------------------------------------------------------------
    def store(self, keys: Sequence[ChunkHash], token_ids: np.ndarray, snapshots: Mapping[int, Snapshot]) -> int:
        """Store ``{boundary: snapshot}`` (boundaries in chunks, ``keys`` the request's chunk keys) into the
        first tier and every write-through tier. Returns how many boundaries some tier newly stored."""
        size = self.chunk_size
        entries: list[Entry] = []
        owners: list[int] = []
        for boundary, snapshot in sorted(snapshots.items()):
            if not 0 < boundary <= len(keys) or set(snapshot) != set(self.specs):
                raise InvalidArgument(f"snapshot at boundary {boundary} must hold {sorted(k.value for k in self.specs)}"
                                      f" and lie within the {len(keys)} full chunks")
            for kind, tensor in snapshot.items():
                self.specs[kind].check(tensor)
                entries.append(Entry(state_key(keys[boundary - 1], kind),
                                     token_ids[(boundary - 1) * size : boundary * size], tensor))
                owners.append(boundary)
        stored: set[int] = set()
        for tier, done in self._chain.store(entries, EntryKind.SNAPSHOT):
            if done:
                self._metrics.inc(SNAPSHOTS_STORED, len(done), tier=tier.name)
            stored.update(owners[i] for i in done)
        return len(stored)
