"""TierChain: the ordered tiers of one cache, fastest first, and the one walk over them.

KVCache (chunks of a prefix), SegmentCache (whole segments) and StateSnapshots (state snapshots) keep their
entries in the same tiers, through this one object. Its rules, the same for every kind of entry:

* **Locate**: a key is in the fastest tier holding it; each tier is asked only about the keys no faster tier
  holds (``locate``). No side effects on eviction order.
* **Write**: a store goes to the first tier and to every ``WriteMode.THROUGH`` tier (``writers``); a
  ``WriteMode.BACK`` tier receives entries only when the tier above evicts them (demotion), re-encoded with its
  own codec. Only what a tier lacks is written to it.
* **Admission**: each tier has an admission policy (kvtier.policy.admission): a write the tier's policy refuses
  is not made, and counted in ``kvtier_admission_refused_total``. The chain reports every sighting to every
  policy: all the keys a store offers (once per store, before any tier is asked) and the keys a request found
  (``sighted``, from lookup and retrieve); a promotion and a demotion are asked as such (``WriteSource``).
* **Read**: every entry read is verified (token ids always, checksum where the tier seals); one that fails is
  a miss, counted in ``kvtier_corrupt_chunks_total`` and deleted from that tier. A verified hit in a slower tier
  is promoted (copied) into every faster tier.
* **Failures**: a tier that raises ``KVTierError`` is counted in ``kvtier_tier_errors_total`` under the
  operation it failed (``contains``, ``get``, ``put``, ``delete``, ``promote``, ``demote``, ``order_chain``; a
  failure anywhere in a write into a tier counts under that write's operation) and becomes a miss or a skipped
  write. Nothing is raised.
* **Events**: each entry newly written into a tier is one stored event with its ``EntryKind``; chunks a request
  stored carry their chain position (``kvtier.core.events`` has the whole rule).

Chunks move through the pipeline (pipeline.py) a window at a time; segments and snapshots, a handful of
entries per request, are read and written here directly. The chain keeps no state besides its tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import torch

from kvtier.base.errors import BlobError, ConfigError, KVTierError
from kvtier.base.keys import ChunkHash
from kvtier.base.metrics import Metrics
from kvtier.codecs import codec_by_id
from kvtier.codecs.blob import encode_blob, parse_blob
from kvtier.core.bounded import UNKNOWN, aligned, batches, blob_bytes
from kvtier.core.events import CacheEvents, EntryKind
from kvtier.core.jobs import Entry, Failure, LoadJob, StoreJob
from kvtier.core.metrics import ADMISSION_REFUSED, DEMOTIONS, PROMOTIONS, STORED_TOKENS
from kvtier.core.pipeline import Pipeline
from kvtier.policy.admission import AdmissionPolicy, AlwaysAdmit, WriteSource, is_always
from kvtier.tiers import ChainOrdered, EvictionReporter, Tier, WriteMode
from kvtier.tiers.control import Controlled, EvictionTags, Tags, put_tagged
from kvtier.tiers.metrics import CORRUPT_CHUNKS, READ_BYTES, TIER_ERRORS

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Verifies one blob read from a tier and copies the entry out of it: ``(tier, key, blob, tokens) -> tensor``,
#: BlobError where it does not verify. The blob is valid only during the call.
Decode = Callable[[Tier, ChunkHash, memoryview, np.ndarray], torch.Tensor]


class TierChain:
    """``tiers`` fastest first with their write modes (``modes[0]`` is ignored: the first tier takes every write)
    and admission policies (``admission``, one per tier; default: every tier admits everything).

    Wires each write-back tier to the eviction listener of the tier above it (ConfigError if that tier reports
    no evictions) and the removal listeners of every tier to ``events``. Thread-safe as far as the tiers are.
    """

    def __init__(self, tiers: Sequence[Tier], modes: Sequence[WriteMode], metrics: Metrics, events: CacheEvents,
                 pipeline: Pipeline, admission: Sequence[AdmissionPolicy] | None = None) -> None:
        self.tiers = list(tiers)
        self.admission = list(admission) if admission is not None else [AlwaysAdmit() for _ in self.tiers]
        if len(self.admission) != len(self.tiers):
            raise ConfigError(f"{len(self.admission)} admission policies for {len(self.tiers)} tiers")
        self._gated = [p for p in self.admission if not is_always(p)]  # the policies that want sightings
        self.metrics = metrics
        self.events = events
        self.pipeline = pipeline
        modes = [WriteMode(mode) for mode in modes]  # a config may hold the mode's value ("back")
        #: the tiers a store writes to, by index: the first, and every write-through one
        self.writers = tuple(t for t, mode in enumerate(modes) if t == 0 or mode is WriteMode.THROUGH)
        for t, mode in enumerate(modes):
            if t and mode is WriteMode.BACK:
                self._feed_from_above(t)
        events.watch(self.tiers)

    def _feed_from_above(self, t: int) -> None:
        upper = self.tiers[t - 1]
        if not isinstance(upper, EvictionReporter):
            raise ConfigError(f"tier {upper.name} cannot feed a write-back tier (it reports no evictions)")
        upper.set_eviction_listener(lambda key, blob: self._demote(key, blob, t))

    # -- locating ------------------------------------------------------------------------------------------
    def locate(self, keys: Sequence[ChunkHash]) -> list[int | None]:
        """For each key, the index of the fastest tier holding it (None where none does)."""
        where: list[int | None] = [None] * len(keys)
        for t, tier in enumerate(self.tiers):
            todo = [i for i, w in enumerate(where) if w is None]
            if not todo:
                break
            try:
                present = tier.contains([keys[i] for i in todo])
            except KVTierError as exc:
                self.failed(tier, "contains", exc)
                continue
            for i, hit in zip(todo, present):
                if hit:
                    where[i] = t
        return where

    @staticmethod
    def prefix(where: Sequence[int | None]) -> int:
        """How many leading entries of a ``locate`` answer some tier holds."""
        for i, t in enumerate(where):
            if t is None:
                return i
        return len(where)

    # -- chunks of a prefix (through the pipeline, window by window) ---------------------------------------
    def store_chunks(self, job: StoreJob) -> list[bool]:
        """Write the chunks of ``job`` each writer lacks; True per chunk newly written to at least one tier."""
        self.sighted(job.keys)
        written = [False] * len(job.keys)
        for t in self.writers:
            for i in self._store_chunks_into(t, job):
                written[i] = True
        return written

    def _store_chunks_into(self, t: int, job: StoreJob) -> list[int]:
        tier = self.tiers[t]
        missing = self._missing(tier, job.keys, "put")
        missing = self.admitted(t, [job.keys[i] for i in missing], [self.pipeline.chunk_bytes] * len(missing),
                                WriteSource.STORE, missing)
        if not missing:
            return []
        result = self.pipeline.encode_and_put(tier, missing, job)
        if result.failure is not None:
            self._count(result.failure)
        size = self.pipeline.chunk_size
        self.events.stored(tier.name, job.keys, result.done, job.token_ids, size, job.extras)
        self.metrics.inc(STORED_TOKENS, len(result.done) * size, tier=tier.name)
        return result.done

    def load_chunks(self, keys: Sequence[ChunkHash], where: Sequence[int | None], token_ids: np.ndarray,
                    sink: object, owner: str = "") -> list[bool]:
        """Load the located chunks into ``sink`` (a KVSink), promoting hits from slower tiers (owned by ``owner``,
        a tenant tag, where the tier they came from records no owner); True per chunk that arrived verified.
        Corrupt chunks are counted and deleted once the load is done. A sink's error reaches the caller once every
        window has ended; nothing of that load is counted or deleted then."""
        promoter = self if not owner else _OwnedPromotions(self, owner)
        result = self.pipeline.load(LoadJob(self.tiers, keys, where, token_ids, sink, promoter))
        self._discard([(c.tier, c.key, c.error) for c in result.corrupt], EntryKind.CHUNK)
        for failure in result.failures:
            self._count(failure)
        return result.ok

    def order_chain(self, keys: Sequence[ChunkHash]) -> None:
        """Tell every tier with a policy a request's chain, root first, once its windows are all done (they load on
        a pool and store window by window, so their touches reach a policy in no chain order)."""
        for tier in self.tiers:
            if isinstance(tier, ChainOrdered):
                try:
                    tier.order_chain(keys)
                except KVTierError as exc:
                    self.failed(tier, "order_chain", exc)

    # -- whole entries (segments, snapshots) ----------------------------------------------------------------
    def store(self, entries: Sequence[Entry], kind: EntryKind) -> list[tuple[Tier, list[int]]]:
        """Write ``entries`` into each writer that lacks them: per writer, the indices it newly stored."""
        out = []
        self.sighted([e.key for e in entries])
        for t in self.writers:
            tier = self.tiers[t]
            missing = self._missing(tier, [e.key for e in entries], "put")
            missing = self.admitted(t, [entries[i].key for i in missing], [entries[i].tensor.nbytes for i in missing],
                                    WriteSource.STORE, missing)
            done = self._put(tier, [entries[i] for i in missing], "put", kind) if missing else []
            out.append((tier, [missing[i] for i in done]))
        return out

    def read(self, tokens: Mapping[ChunkHash, np.ndarray], decode: Decode,
             kind: EntryKind) -> dict[ChunkHash, tuple[torch.Tensor, int]]:
        """The verified copy of each key of ``tokens`` (its token ids) and the index of the tier it came from,
        fastest tier first; ``decode`` verifies and copies. A copy that fails is deleted and looked for in the
        slower tiers; a hit below the first tier is promoted. Keys found nowhere are absent."""
        found: dict[ChunkHash, tuple[torch.Tensor, int]] = {}
        for t in range(len(self.tiers)):
            todo = [key for key in tokens if key not in found]
            if not todo:
                break
            hits = self._read_tier(t, todo, tokens, decode, kind)
            found.update((key, (tensor, t)) for key, tensor in hits.items())
        return found

    def _read_tier(self, t: int, keys: Sequence[ChunkHash], tokens: Mapping[ChunkHash, np.ndarray], decode: Decode,
                   kind: EntryKind) -> dict[ChunkHash, torch.Tensor]:
        tier = self.tiers[t]
        present = [key for key, w in zip(keys, self.locate_in(t, keys)) if w]
        found: dict[ChunkHash, torch.Tensor] = {}
        bad: list[tuple[int, ChunkHash, BlobError]] = []
        if not present:
            return found
        if kind is EntryKind.SNAPSHOT:  # a state's size is not its tokens' KV: one snapshot per bounded get
            sizes = [UNKNOWN] * len(present)
        else:
            sizes = [blob_bytes(self.pipeline.spec, len(tokens[key])) for key in present]
        try:
            for batch in batches(tier, sizes):  # gets a BoundedGets tier holds whole (kvtier/core/bounded.py)
                with tier.get([present[i] for i in batch]) as blobs:
                    for key, blob in zip([present[i] for i in batch], blobs):
                        if blob is None:
                            continue
                        try:
                            found[key] = decode(tier, key, blob, tokens[key])
                        except BlobError as exc:
                            bad.append((t, key, exc))
                            continue
                        self.metrics.inc(READ_BYTES, blob.nbytes, tier=tier.name)
        except KVTierError as exc:
            self.failed(tier, "get", exc)
        self._discard(bad, kind)
        if found and t > 0:
            self.promote(t, [Entry(key, tokens[key], tensor) for key, tensor in found.items()], kind)
        return found

    def locate_in(self, t: int, keys: Sequence[ChunkHash]) -> list[bool]:
        """Which ``keys`` tier ``t`` holds now (none where it fails)."""
        try:
            return self.tiers[t].contains(keys)
        except KVTierError as exc:
            self.failed(self.tiers[t], "contains", exc)
            return [False] * len(keys)

    # -- moving between tiers --------------------------------------------------------------------------------
    def promote(self, found_in: int, entries: Sequence[Entry], kind: EntryKind = EntryKind.CHUNK,
                owner: str = "") -> None:
        """Copy ``entries``, found in tier ``found_in`` (so no faster tier held them), into every faster tier. The
        tensors may view the slower tier's memory: valid only during the call, which copies them. Each entry
        keeps its owner and expiry (kvtier/tiers/control.py) where the slower tier records them; else it is owned by
        ``owner``. Each faster tier's admission policy is asked first (as promotions)."""
        groups = self._by_tags(self.tiers[found_in], entries, Tags(owner) if owner else None)
        for t, tier in enumerate(self.tiers[:found_in]):
            done = 0
            for tags, group in groups.items():
                admitted = self.admitted(t, [e.key for e in group], [e.tensor.nbytes for e in group],
                                         WriteSource.PROMOTE, group)
                done += len(self._put(tier, admitted, "promote", kind, tags)) if admitted else 0
            if done:
                self.metrics.inc(PROMOTIONS, done, tier=tier.name)

    def _by_tags(self, tier: Tier, entries: Sequence[Entry], fallback: Tags | None) -> dict[Tags | None, list[Entry]]:
        """``entries`` grouped by the tags ``tier`` has for them (``fallback`` where it has none)."""
        tags: list[Tags | None] = [None] * len(entries)
        if isinstance(tier, Controlled):
            try:
                tags = tier.tags_of([e.key for e in entries])
            except KVTierError as exc:
                self.failed(tier, "promote", exc)
        groups: dict[Tags | None, list[Entry]] = {}
        for entry, tag in zip(entries, tags):
            groups.setdefault(tag if tag is not None else fallback, []).append(entry)
        return groups

    def _demote(self, key: ChunkHash, blob: memoryview, t: int) -> None:
        """Write-back: re-encode an entry the tier above ``t`` is evicting into tier ``t``. Runs as that tier's
        eviction listener, while ``blob`` is still valid (see EvictionReporter); its kind is unknown."""
        target = self.tiers[t]
        try:
            header, payload = parse_blob(blob, key, verify=False)
            tensor = codec_by_id(header.codec_id).decode(payload, header.shape, header.dtype)
        except KVTierError as exc:
            self.failed(target, "demote", exc)
            return
        if not self.admitted(t, [key], [tensor.nbytes], WriteSource.DEMOTE, [True]):
            return
        upper = self.tiers[t - 1]
        tags = upper.evicting_tags() if isinstance(upper, EvictionTags) else None  # its owner and expiry go along
        if self._put(target, [Entry(key, header.tokens(blob), tensor)], "demote", None, tags):
            self.metrics.inc(DEMOTIONS, tier=target.name)

    # -- admission -----------------------------------------------------------------------------------------
    def sighted(self, keys: Sequence[ChunkHash]) -> None:
        """A request sighted ``keys`` (offered them for a store, or found them): tell the admission policies."""
        if keys:
            for policy in self._gated:
                policy.seen(keys)

    def admitted(self, t: int, keys: Sequence[ChunkHash], nbytes: Sequence[int], source: WriteSource,
                 items: Sequence[T]) -> list[T]:
        """The ``items`` (one per key) whose write into tier ``t`` its admission policy admits; refusals counted."""
        policy = self.admission[t]
        if not keys or is_always(policy):
            return list(items)
        verdicts = policy.admit(keys, nbytes, source)
        for refusal in set(verdicts) - {None}:
            self.metrics.inc(ADMISSION_REFUSED, verdicts.count(refusal), tier=self.tiers[t].name, reason=refusal.value)
        return [item for item, refusal in zip(items, verdicts) if refusal is None]

    # -- writing, deleting, counting -----------------------------------------------------------------------
    def _missing(self, tier: Tier, keys: Sequence[ChunkHash], op: str) -> list[int]:
        """Indices of the ``keys`` ``tier`` lacks (none where it fails: counted under ``op``)."""
        try:
            present = tier.contains(keys)
        except KVTierError as exc:
            self.failed(tier, op, exc)
            return []
        return [i for i, p in enumerate(present) if not p]

    def _put(self, tier: Tier, entries: Sequence[Entry], op: str, kind: EntryKind | None,
             tags: Tags | None = None) -> list[int]:
        """Encode ``entries`` for ``tier`` (its codec, sealed where it verifies) and put them with ``tags``, in puts
        a ``BoundedGets`` tier holds; the indices it stored, reported as entering it. A failure is counted under
        ``op`` and stores nothing more."""
        try:
            blobs = [(e.key, encode_blob(e.key, e.tokens, tier.codec, e.tensor, seal=tier.verifies)) for e in entries]
        except KVTierError as exc:
            self.failed(tier, op, exc)
            return []
        done: list[int] = []
        for batch in batches(tier, [aligned(blob.nbytes) for _, blob in blobs]):  # puts a bounded tier holds
            try:
                stored = put_tagged(tier, [blobs[i] for i in batch], tags)
            except KVTierError as exc:
                self.failed(tier, op, exc)
                break
            done.extend(i for i, ok in zip(batch, stored) if ok)
        self.events.entered(tier.name, [entries[i].key for i in done], kind)
        return done

    def _discard(self, bad: Sequence[tuple[int, ChunkHash, BlobError]], kind: EntryKind) -> None:
        """Entries that failed verification: each a counted miss, deleted from the tier it was read from."""
        by_tier: dict[int, list[ChunkHash]] = {}
        for t, key, exc in bad:
            tier = self.tiers[t]
            self.metrics.inc(CORRUPT_CHUNKS, tier=tier.name)
            log.warning("tier %s: %s %s is a miss: %s", tier.name, kind.value, key.hex()[:16], exc)
            by_tier.setdefault(t, []).append(key)
        for t, keys in by_tier.items():
            try:
                self.tiers[t].delete(keys)
            except KVTierError as exc:
                self.failed(self.tiers[t], "delete", exc)

    def _count(self, failure: Failure) -> None:
        self.failed(failure.tier, failure.op, failure.error)

    def failed(self, tier: Tier, op: str, exc: KVTierError) -> None:
        """Count and log a failure of ``tier`` on ``op``; the caller turns it into a miss or a skipped write."""
        self.metrics.inc(TIER_ERRORS, tier=tier.name, op=op)
        log.warning("tier %s failed on %s: %s", tier.name, op, exc)



class _OwnedPromotions:
    """The Promoter of a load whose caller knows the entries' owner (the tenant it derived the keys for)."""

    def __init__(self, chain: TierChain, owner: str) -> None:
        self.chain, self.owner = chain, owner

    def promote(self, found_in: int, entries: Sequence[Entry]) -> None:
        self.chain.promote(found_in, entries, owner=self.owner)
