"""Admission policies: which writes a tier accepts, one policy per tier, looked up by name in ``ADMISSIONS``.

Eviction decides what leaves a tier; admission decides what enters it. Many chunks of a real trace are never
reused, and every store to a disk, a Redis server or a pool costs bandwidth that hits need. Policies (a tier's
``admission`` option):

* ``always``: every write is admitted (what kvtier always did).
* ``second-hit``: an entry is admitted only once it has been *sighted twice*: a chunk offered by a store for
  the first time is refused, and admitted the next time a request offers it or hits it. Sightings are kept in
  a count-min sketch (kvtier.policy.sketch) sized for ``sketch_chunks`` distinct keys.

And, on top of either, a byte-rate cap (``admission_max_bytes_per_s``, meant for shared tiers): a token bucket
that refills at that rate up to ``burst_bytes`` and admits an entry while it is not in debt, charging its
bytes (the entry's raw KV bytes, before the tier's codec), so over any interval a tier receives at most about
``rate x interval + burst + one entry`` bytes from this process. The cap is per process: a shared tier fed by
``n`` replicas receives up to ``n`` times it.

Contract (tests/conformance/admission_suite.py checks every registered policy):

* The chain (kvtier.core.chain) calls ``seen(keys)`` for every sighting a request makes: once with all the
  keys a store offers (before it asks ``admit`` about them), and with the keys a lookup or retrieve found in
  some tier (a hit is a reuse). ``seen`` never raises and never refuses anything.
* ``admit(keys, nbytes, source)`` answers, per key, None (admitted) or the ``Refusal`` that kept it out (a
  short constant: it labels ``kvtier_admission_refused_total``). It never raises; it is asked only about
  entries the tier lacks, and an admitted entry is charged (rate cap) whether or not the tier then stores it.
* ``source`` says where the write comes from. ``STORE``: a request stored it. ``PROMOTE``: a hit in a slower
  tier is copied into this faster one; a hit is a second sighting, so ``second-hit`` admits every promotion.
  ``DEMOTE``: write-back, the tier above is evicting it; an eviction is **not** a sighting, so ``second-hit``
  admits a demotion only if the entry was sighted twice while it was cached above (it was reused: evicted
  one-shot chunks are dropped, which is SGLang HiCache's ``write_through_selective`` for write-back tiers).
* Thread-safe: a policy locks its own state.

False positives: ``second-hit`` may admit a never-seen chunk when all four of its sketch counters were raised
by other keys; with ``COUNTERS_PER_ENTRY`` counters per remembered chunk per row that is about one key in
``(64 x sketch_chunks / distinct keys)^4`` (negligible while the distinct keys in a window stay near
``sketch_chunks``). It never refuses a chunk sighted twice within a window, except after aging: every count
halves after ``10 x sketch_chunks`` sightings, so a chunk whose two sightings lie that far apart may be refused
again. Memory: 256 bytes per sketch chunk (4 MiB at the default 16,384).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.base.errors import ConfigError
from kvtier.base.registry import Registry
from kvtier.policy.sketch import FrequencySketch

#: Distinct chunks a ``second-hit`` sketch is sized for unless configured otherwise.
DEFAULT_SKETCH_CHUNKS = 16_384


class WriteSource(enum.Enum):
    """Where a write into a tier comes from."""

    STORE = "store"  #: a request stored it (write-through, or the first tier)
    PROMOTE = "promote"  #: a hit in a slower tier, copied into a faster one
    DEMOTE = "demote"  #: write-back: the tier above evicted it


class Refusal(enum.StrEnum):
    """Why an admission policy kept an entry out (the ``reason`` label of the refusal metric)."""

    UNSEEN = "unseen"  #: ``second-hit``: not sighted twice yet
    RATE = "rate"  #: over the tier's byte-rate cap


class AdmissionPolicy(Protocol):
    """Decides which writes one tier accepts (see the module's contract)."""

    def seen(self, keys: Sequence[bytes]) -> None:
        """A request sighted ``keys`` (a store offered them, or a lookup or retrieve found them)."""

    def admit(self, keys: Sequence[bytes], nbytes: Sequence[int], source: WriteSource) -> list[Refusal | None]:
        """Per key: None where the write of ``nbytes[i]`` bytes may go to the tier, else why not."""


@dataclass(frozen=True)
class AdmissionSettings:
    """A tier's admission options (its config's ``admission*`` fields)."""

    policy: str = "always"
    sketch_chunks: int = DEFAULT_SKETCH_CHUNKS
    max_bytes_per_s: int | None = None
    burst_bytes: int | None = None

    def __post_init__(self) -> None:
        ADMISSIONS.lookup(self.policy)
        if self.sketch_chunks < 1:
            raise ConfigError(f"admission_sketch_chunks must be at least 1, got {self.sketch_chunks}")
        if self.max_bytes_per_s is not None and self.max_bytes_per_s <= 0:
            raise ConfigError(f"admission_max_bytes_per_s must be positive, got {self.max_bytes_per_s}")
        if self.burst_bytes is not None and self.burst_bytes < 0:
            raise ConfigError(f"admission_burst_bytes must not be negative, got {self.burst_bytes}")


class AlwaysAdmit:
    """``always``: every write is admitted; sightings are ignored."""

    def __init__(self, settings: AdmissionSettings | None = None) -> None:
        pass

    def seen(self, keys: Sequence[bytes]) -> None:
        return None

    def admit(self, keys: Sequence[bytes], nbytes: Sequence[int], source: WriteSource) -> list[Refusal | None]:
        return [None] * len(keys)


class SecondHit:
    """``second-hit``: admit an entry sighted at least twice (a promotion always: a hit is its second sighting)."""

    def __init__(self, settings: AdmissionSettings | None = None) -> None:
        chunks = (settings or AdmissionSettings()).sketch_chunks
        self._sketch = FrequencySketch(chunks)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Memory the sketch takes."""
        return self._sketch.nbytes

    def seen(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._sketch.increment(key)

    def admit(self, keys: Sequence[bytes], nbytes: Sequence[int], source: WriteSource) -> list[Refusal | None]:
        if source is WriteSource.PROMOTE:
            return [None] * len(keys)
        with self._lock:
            return [None if self._sketch.estimate(key) >= 2 else Refusal.UNSEEN for key in keys]


class RateCapped:
    """``inner``'s decisions, then a token bucket: ``rate`` bytes per second, at most ``burst`` saved up.

    An entry ``inner`` admits is admitted while the bucket is not in debt and charged its bytes (so the bucket
    may go into debt by one entry, and an entry larger than the burst is still admitted now and then). ``clock``
    gives seconds (monotonic; injectable for tests and for the simulator's trace time)."""

    def __init__(self, inner: AdmissionPolicy, rate: float, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.rate = float(rate)
        self.burst = float(rate if burst is None else burst)
        self._clock = clock
        self._tokens = self.burst
        self._last: float | None = None
        self._lock = threading.Lock()

    def seen(self, keys: Sequence[bytes]) -> None:
        self.inner.seen(keys)

    def admit(self, keys: Sequence[bytes], nbytes: Sequence[int], source: WriteSource) -> list[Refusal | None]:
        out = self.inner.admit(keys, nbytes, source)
        with self._lock:
            now = self._clock()
            if self._last is not None and now > self._last:
                self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now if self._last is None else max(self._last, now)
            for i, refusal in enumerate(out):
                if refusal is not None:
                    continue
                if self._tokens > 0:
                    self._tokens -= nbytes[i]
                else:
                    out[i] = Refusal.RATE
        return out


#: name -> factory called with the tier's AdmissionSettings. A new policy is one class and one line here.
ADMISSIONS: Registry[Callable[[AdmissionSettings], AdmissionPolicy]] = Registry("admission policy")
ADMISSIONS.register("always", __name__, "AlwaysAdmit")
ADMISSIONS.register("second-hit", __name__, "SecondHit")


def make_admission(settings: AdmissionSettings, clock: Callable[[], float] = time.monotonic) -> AdmissionPolicy:
    """The policy ``settings`` describe, wrapped in its rate cap where it has one."""
    policy = ADMISSIONS.lookup(settings.policy)(settings)
    if settings.max_bytes_per_s is not None:
        return RateCapped(policy, settings.max_bytes_per_s, settings.burst_bytes, clock)
    return policy


def is_always(policy: AdmissionPolicy) -> bool:
    """True for a policy that admits everything (the chain skips asking it)."""
    return isinstance(policy, AlwaysAdmit)
