"""Model state beyond attention KV: the kinds a model's prefix cache holds, and where state snapshots live.

A transformer's prefix state is its attention KV, which grows with the prompt and is cached chunk by chunk.
An SSM (Mamba) layer instead carries a fixed-size recurrent state, a convolution state and an SSM state,
that summarises everything before it. Restoring a prefix of ``k`` chunks therefore needs the attention KV of
chunks ``1..k`` *and* every SSM layer's state exactly at the end of chunk ``k``: a *snapshot* at boundary
``k``. A hit needs every kind the model has.

* :class:`StateKind` names the kinds. A snapshot holds one tensor per state kind, the states of every SSM
  layer stacked: ``[slots, *shape]`` (a slot is one layer's state; a few models keep several per layer).
* :class:`ModelStateSpec` is a model's full description: its attention KV (a :class:`KVSpec`, or None for
  a pure SSM model) and one :class:`StateSpec` per state kind. Its ``key_fields`` go into the namespace, so
  the chain hashes cover state shapes and dtypes as they cover the KV spec.
* :func:`state_key` names the snapshot of one kind at one boundary: a digest of the boundary's chunk hash
  (the same chain hash the KV chunk is stored under) and a marker of the kind. Snapshots are stored as
  ordinary verified blobs under these keys, in the same tiers as KV chunks.
* :class:`SnapshotPolicy` decides at which boundaries snapshots are stored (every one, every m-th, the last
  full boundary of each request), trading stored bytes against where later prompts can hit.

Recurrent state is never stored lossily: an error in it compounds over every later token. KVCache refuses a
lossy codec on any tier of a model with state kinds.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.base.errors import ConfigError, InvalidArgument
from kvtier.base.hashes import ChunkHash
from kvtier.base.layout import KVSpec, dtype_from_name, dtype_name

if TYPE_CHECKING:
    import torch

_STATE_DOMAIN = b"kvtier/state/v1"


class StateKind(enum.Enum):
    """What a piece of a model's prefix state is. The value is stable: it is hashed into snapshot keys."""

    ATTENTION_KV = "attention_kv"  #: attention K and V, stored per chunk
    CONV = "conv"  #: the last kernel-width inputs of each SSM layer's causal convolution, per boundary
    SSM = "ssm"  #: each SSM layer's recurrent state, per boundary
    #: each sliding-window attention layer's K and V of the window before a boundary, per boundary (an engine
    #: that frees KV outside the window keeps nothing else a later request could continue from)
    WINDOW = "window"


@dataclass(frozen=True)
class StateSpec:
    """One state kind of a model: ``slots`` tensors of ``shape`` and ``dtype``, snapshot as ``[slots, *shape]``."""

    kind: StateKind
    slots: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.kind is StateKind.ATTENTION_KV:
            raise ConfigError("attention KV is described by a KVSpec, not a StateSpec")
        if not isinstance(self.slots, int) or self.slots <= 0:
            raise ConfigError(f"StateSpec.slots must be a positive int, got {self.slots!r}")
        shape = tuple(self.shape)
        if not shape or any(not isinstance(d, int) or d <= 0 for d in shape) or len(shape) > 6:
            raise ConfigError(f"StateSpec.shape must be 1 to 6 positive ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))

    @property
    def snapshot_shape(self) -> tuple[int, ...]:
        return (self.slots, *self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of one snapshot of this kind."""
        return math.prod(self.snapshot_shape) * self.dtype.itemsize

    def check(self, tensor: torch.Tensor) -> None:
        """Raise InvalidArgument unless ``tensor`` is a snapshot of this kind."""
        if tuple(tensor.shape) != self.snapshot_shape or tensor.dtype != self.dtype:
            raise InvalidArgument(f"{self.kind.value} snapshot must be {self.snapshot_shape} {self.dtype}, "
                              f"got {tuple(tensor.shape)} {tensor.dtype}")


@dataclass(frozen=True)
class ModelStateSpec:
    """Everything a model's prefix state consists of: attention KV (None for pure SSM models) and state kinds."""

    attention: KVSpec | None
    states: tuple[StateSpec, ...] = ()

    def __post_init__(self) -> None:
        states = tuple(self.states)
        kinds = [s.kind for s in states]
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"state kinds must be distinct, got {[k.value for k in kinds]}")
        if self.attention is None and not states:
            raise ConfigError("a model holds attention KV, state kinds, or both")
        object.__setattr__(self, "states", states)

    @classmethod
    def of(cls, spec: KVSpec | ModelStateSpec) -> ModelStateSpec:
        """``spec`` itself, or an attention-only ModelStateSpec around a KVSpec."""
        return spec if isinstance(spec, ModelStateSpec) else cls(spec)

    @property
    def kinds(self) -> tuple[StateKind, ...]:
        """Every kind a prefix hit needs."""
        head = (StateKind.ATTENTION_KV,) if self.attention is not None else ()
        return head + tuple(s.kind for s in self.states)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one state snapshot (all state kinds at one boundary)."""
        return sum(s.nbytes for s in self.states)

    def key_fields(self) -> Iterator[tuple[str, str | int]]:
        """Named fields hashed into the namespace root (see keys.Namespace)."""
        if self.attention is not None:
            yield from self.attention.key_fields()
        else:
            yield "attention", "none"
        for state in self.states:
            yield f"{state.kind.value}_slots", state.slots
            yield f"{state.kind.value}_shape", "x".join(map(str, state.shape))
            yield f"{state.kind.value}_dtype", dtype_name(state.dtype)


def state_key(chunk_key: ChunkHash, kind: StateKind) -> ChunkHash:
    """The key of the ``kind`` snapshot at the boundary that ends the chunk stored under ``chunk_key``.

    ``SHA-256(domain || u32 len(kind) || kind || chunk_key)``: tied to the same chain hash (so to the whole
    token history, the namespace and its tenant salt) and never equal to a chunk key or another kind's key.
    """
    marker = kind.value.encode("ascii")
    return ChunkHash(hashlib.sha256(_STATE_DOMAIN + struct.pack("<I", len(marker)) + marker + chunk_key).digest())


_POLICY = re.compile(r"^(?:(last)|every(?:-(\d+))?)$")


@dataclass(frozen=True)
class SnapshotPolicy:
    """At which chunk boundaries state snapshots are stored.

    ``interval``: every ``interval``-th boundary (1 = every boundary; None = none). ``last``: the last full
    boundary of each request. Config strings: ``every``, ``every-<m>``, ``last``, or two joined by ``+``
    (``last+every-16``). Boundaries a request hit in the cache are never stored again.
    """

    interval: int | None = None
    last: bool = True

    def __post_init__(self) -> None:
        if self.interval is not None and (not isinstance(self.interval, int) or self.interval <= 0):
            raise ConfigError(f"snapshot interval must be a positive int, got {self.interval!r}")
        if self.interval is None and not self.last:
            raise ConfigError("a snapshot policy stores at some boundaries: give an interval, last, or both")

    @classmethod
    def parse(cls, value: str | SnapshotPolicy) -> SnapshotPolicy:
        if isinstance(value, SnapshotPolicy):
            return value
        interval, last = None, False
        for part in str(value).strip().lower().split("+"):
            match = _POLICY.match(part.strip())
            if match is None:
                raise ConfigError(f"state_snapshots: cannot read {value!r} (try every, every-8, last, last+every-16)")
            if match.group(1):
                last = True
            else:
                interval = int(match.group(2) or 1)
        return cls(interval, last)

    def __str__(self) -> str:
        parts = (["last"] if self.last else []) + ([] if self.interval is None else
                                                  ["every" if self.interval == 1 else f"every-{self.interval}"])
        return "+".join(parts)

    def boundaries(self, cached: int, prompt_tokens: int, chunk_size: int) -> list[int]:
        """Boundaries (counted in chunks, ascending) to snapshot for a prompt of ``prompt_tokens`` tokens whose
        first ``cached`` chunks came from the cache.

        ``last`` is the prompt's last full boundary, and for a prompt of whole chunks also the one before it:
        the engine always computes at least one token, so a repeat of such a prompt can restore only the
        boundary before its end, while a longer prompt (the next round of a chat) can restore its end.
        """
        chosen = set()
        full = prompt_tokens // chunk_size
        if self.interval is not None:
            first = (cached // self.interval + 1) * self.interval
            chosen.update(range(first, full + 1, self.interval))
        if self.last:
            chosen.update(k for k in {full, (prompt_tokens - 1) // chunk_size} if k > cached)
        return sorted(chosen)
