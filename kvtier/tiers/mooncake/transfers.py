"""The Mooncake tier's gets and puts (a base class of MooncakeTier, as MooncakeControl is): values move between
the pool and the registered transfer buffer (buffers.py) in batch calls that each fit it (slices.py).

Put: the values are cut into slices of at most half the buffer (and ``PUT_SLICE_BYTES``); each slice is written into the buffer and sent
with ``batch_put_from`` while the next one is written, and its room is handed back when its call ends. Get: the
values' sizes are asked for once (``batch_get_replica_desc``), then each slice that fits the buffer is read with
``batch_get_into``; a get that fits is read in one call and its views are the buffer itself; one that does not
is read slice after slice, each but the last copied out into spill memory before the next is read. A slice that
fails is a miss or a skipped store for its values only; every slice shares the call's one deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import monotonic

import torch

from kvtier.base.errors import TierError
from kvtier.base.keys import ChunkHash
from kvtier.base.metrics import declare_counter
from kvtier.codecs import Payload
from kvtier.codecs.base import copy_tensors
from kvtier.tiers.metrics import WRITTEN_BYTES
from kvtier.tiers.mooncake.buffers import Lease
from kvtier.tiers.mooncake.calls import CallNotStarted, CallTimedOut
from kvtier.tiers.mooncake.client import MASTER_DOWN, Code, Moving
from kvtier.tiers.mooncake.slices import cut

NO_BUFFER = declare_counter("kvtier_mooncake_no_buffer_total",
                            "Values not read because the Mooncake tier's transfer buffer was full.", ("tier",))
BUSY = declare_counter("kvtier_mooncake_busy_total",
                       "Mooncake calls given up because this replica queued them (other transfers' turns, the "
                       "transfer buffer) until too little of their deadline was left.", ("op", "tier"))
#: A put's slices are at most this large (and half the buffer): writing the first slice into the buffer overlaps
#: nothing, so it is kept short; a KV chunk of 8B-sized models (32 MiB) is one slice
PUT_SLICE_BYTES = 64 << 20


class MooncakeTransfers:
    """Needs, from the tier: ``name``, ``config``, ``_metrics``, ``_client``, ``_buffers``, ``_spill``, and the
    helpers ``_usable``, ``_judge``, ``_failed``, ``_timed_out``, ``_timed_stage``, ``_skipped``, ``_names``."""

    # -- put -------------------------------------------------------------------------------------------------
    def _put_slices(self, items: Sequence[tuple[ChunkHash, Payload]], todo: list[int], out: list[bool]) -> None:
        """Put ``items[i]`` for each ``i`` in ``todo``, slice by slice, one slice written while the last moves."""
        sizes = [items[i][1].nbytes for i in todo]
        deadline = monotonic() + self.config.timeout_s + sum(sizes) / self.config.min_rate_bytes
        buffers = self._buffers
        moving: tuple[list, Moving] | None = None
        try:
            for part in cut(sizes, max(1, min(buffers.capacity // 2, PUT_SLICE_BYTES)), buffers.rounded):
                staged, lease = self._stage(items, [todo[j] for j in part], deadline)
                if moving is not None:
                    last, moving = moving, None
                    self._sent(items, *last, deadline, out)
                moving = self._start_send(items, staged, lease, deadline) if staged else None
        finally:
            if moving is not None:  # waited for even when writing the next slice raised: it holds a turn
                self._sent(items, *moving, deadline, out)

    def _stage(self, items: Sequence[tuple[ChunkHash, Payload]], idx: list[int],
               deadline: float) -> tuple[list, Lease]:
        """Room in the buffer for ``idx`` and their bytes written there: ``(i, slot)`` of those that got room."""
        asked = monotonic()
        lease = self._buffers.take([items[i][1].nbytes for i in idx], deadline)
        try:
            copying = monotonic()
            self._timed_stage("put", "buffer", copying - asked)
            staged = [(i, slot) for i, slot in zip(idx, lease.slots) if slot is not None]
            self._skipped("no_buffer", len(idx) - len(staged))
            for i, slot in staged:
                items[i][1].write_into(slot.view)
            self._timed_stage("put", "copy", monotonic() - copying)
        except BaseException:
            lease.release()
            raise
        if not staged:
            lease.release()
        return staged, lease

    def _start_send(self, items: Sequence[tuple[ChunkHash, Payload]], staged: list, lease: Lease,
                    deadline: float) -> tuple[list, Moving] | None:
        """The staged slice's put under way (its room handed back when the call ends); None if it never started."""
        try:
            return staged, self._client.start_put([self._name(items[i][0]) for i, _ in staged],
                                                  [s.ptr for _, s in staged], [s.nbytes for _, s in staged],
                                                  deadline, on_end=lease.release)
        except CallNotStarted:  # this replica is busy, the pool is not at fault
            lease.release()
            self._metrics.inc(BUSY, tier=self.name, op="put")
            self._skipped("busy", len(staged))
            return None

    def _sent(self, items: Sequence[tuple[ChunkHash, Payload]], staged: list, moving: Moving, deadline: float,
              out: list[bool]) -> None:
        """Wait for a slice's put and record each value's outcome in ``out``."""
        try:
            codes = moving.wait(deadline)
        except CallTimedOut as exc:
            self._skipped("unavailable" if self._timed_out("put", exc) else "busy", len(staged))
            return
        except TierError as exc:
            self._failed("put", exc)
            self._skipped("unavailable", len(staged))
            return
        self._judge("put", codes)
        for (i, slot), code in zip(staged, codes):
            if code in (Code.OK, Code.OBJECT_ALREADY_EXISTS):
                out[i] = True
                if code == Code.OK:
                    self._metrics.inc(WRITTEN_BYTES, slot.nbytes, tier=self.name)
            elif code == Code.NO_AVAILABLE_HANDLE:
                self._skipped("pool_full")
            elif code in MASTER_DOWN or code == Code.TRANSFER_FAIL:
                self._skipped("unavailable")
            else:
                self._skipped("refused")

    # -- get -------------------------------------------------------------------------------------------------
    def _get(self, keys: Sequence[ChunkHash], views: list) -> list[Callable[[], None]]:
        """Fill ``views`` with the values found; what to call when the caller is done with them (nothing where a
        late call will release its slice's room itself)."""
        start = monotonic()
        names = self._names(keys)
        try:
            sizes = self._client.sizes(names, start + self.config.timeout_s)
        except CallTimedOut as exc:
            self._timed_out("get", exc)
            return []
        except TierError as exc:
            self._failed("get", exc)
            return []
        finally:
            self._timed_stage("get", "sizes", monotonic() - start)
        found = [i for i, n in enumerate(sizes) if n is not None and 0 < n <= self.config.max_value_bytes]
        wanted = [sizes[i] or 0 for i in found]
        deadline = start + self.config.timeout_s + sum(wanted) / self.config.min_rate_bytes
        parts = [[found[j] for j in part] for part in cut(wanted, self._buffers.capacity, self._buffers.rounded)]
        if len(parts) <= 1:
            lease = self._read(names, found, sizes, deadline, views) if found else None
            return [] if lease is None else [lease.release]
        spill = self._spill.take(sum(self._buffers.rounded(sizes[i] or 0) for part in parts[:-1] for i in part))
        at = 0
        for part in parts[:-1]:  # each copied out before the next is read into the buffer
            lease = self._read(names, part, sizes, deadline, views)
            if lease is None:
                continue
            pairs = []
            for i in part:
                if views[i] is not None:
                    n = views[i].nbytes
                    pairs.append((spill[at : at + n], views[i]))
                    views[i] = memoryview(spill[at : at + n])
                    at += self._buffers.rounded(n)
            copy_tensors([(_tensor(dst), _tensor(src)) for dst, src in pairs])
            lease.release()
        lease = self._read(names, parts[-1], sizes, deadline, views)
        return [lambda: self._spill.give_back(spill)] + ([] if lease is None else [lease.release])

    def _read(self, names: list[str], idx: list[int], sizes: list, deadline: float, views: list) -> Lease | None:
        """Read the values ``idx`` (of the sizes found) into the buffer and their views into ``views``; the lease
        to release once they are no longer read (None when nothing is held, or a late call will release it)."""
        wanted = [sizes[i] for i in idx]
        asked = monotonic()
        lease = self._buffers.take(wanted, deadline, load=True)
        self._timed_stage("get", "buffer", monotonic() - asked)
        slots = [(i, slot) for i, slot in zip(idx, lease.slots) if slot is not None]
        if len(slots) < len(idx):
            self._metrics.inc(NO_BUFFER, len(idx) - len(slots), tier=self.name)
        if not slots:
            lease.release()
            return None
        try:
            codes = self._client.get_into([names[i] for i, _ in slots], [s.ptr for _, s in slots],
                                          [s.nbytes for _, s in slots], deadline, on_late=lambda _: lease.release())
        except CallTimedOut as exc:
            self._timed_out("get", exc)
            return None  # the call goes on: it releases the lease when it ends
        except BaseException as exc:
            lease.release()
            if isinstance(exc, CallNotStarted):  # this replica is busy, the pool is not at fault
                self._metrics.inc(BUSY, tier=self.name, op="get")
                return None
            if not isinstance(exc, TierError):
                raise
            self._failed("get", exc)
            return None
        self._judge("get", codes)
        for (i, slot), code in zip(slots, codes):
            if 0 < code <= slot.nbytes:
                views[i] = slot.view[:code]
        return lease


def _tensor(view) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8)
