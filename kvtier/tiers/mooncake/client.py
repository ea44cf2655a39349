"""One Mooncake Store client: joins the pool when the master answers, and makes the calls the tier needs, each
bounded by a deadline (see calls.py), their failures translated into ``TierError``. The ``mooncake`` package is
imported here, when a tier is built, never by ``import kvtier``.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from time import monotonic
from typing import Any, TypeVar

from kvtier.base.errors import ConfigError, TierError
from kvtier.tiers.mooncake.calls import CallNotStarted, DeadlineCalls, Pending
from kvtier.tiers.mooncake.config import (
    ENGINE_LOCAL_BUFFER_BYTES,
    MooncakeTierConfig,
    master_host_port,
    segment_size,
)
from kvtier.tiers.mooncake.turns import Turns

log = logging.getLogger(__name__)
T = TypeVar("T")


class Code(enum.IntEnum):
    """The result codes of Mooncake's calls that the tier tells apart (its ``ErrorCode``)."""

    OK = 0
    NO_AVAILABLE_HANDLE = -200  #: no room in the pool right now (eviction runs in the background)
    INVALID_PARAMS = -600  #: e.g. a buffer smaller than the value
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    TRANSFER_FAIL = -800  #: the peer holding (or receiving) the value did not answer
    RPC_FAIL = -900  #: the master did not answer
    RPC_TIMEOUT = -901


#: Codes that mean the master itself is unreachable: they count against the circuit breaker.
MASTER_DOWN = frozenset({Code.RPC_FAIL, Code.RPC_TIMEOUT})


def _engine_env(config: MooncakeTierConfig) -> None:
    """Mooncake reads its settings from the environment when a client starts. Bound its own waits near ours,
    so workers stuck on a dead master or peer come back soon after the tier gave up on them, and keep its
    log to warnings. Variables already set win (they are process-wide: the first tier built sets them)."""
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(100, int(config.timeout_s * 1000))))
    os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", str(max(100, int(config.connect_timeout_s * 1000))))
    os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", str(max(1, math.ceil(config.timeout_s))))
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


def _guarded(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` with the errors the engine's bindings raise turned into TierError (a miss, never a crash)."""
    def call(*args: Any) -> T:
        try:
            return fn(*args)
        except (RuntimeError, ValueError, MemoryError) as exc:
            raise TierError(f"mooncake {fn.__name__}: {exc}") from exc

    call.__name__ = fn.__name__
    return call


def advertised_hostname(config: MooncakeTierConfig) -> str:
    """``local_hostname``, or the local address of this host's route to the master (no packet is sent)."""
    if config.local_hostname:
        return config.local_hostname
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(master_host_port(config))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _free_memory(device: str) -> int:
    """Bytes free now on ``device``: MemAvailable for host RAM, the driver's figure for a GPU."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


#: ``(op, stage, seconds)``: where a transfer's time went (see ``MooncakeClient``)
StageTimer = Callable[[str, str, float], None]


class Moving:
    """A transfer under way, holding one of its client's turns until ``wait`` returns (see MooncakeClient)."""

    def __init__(self, pending: Pending[list[int]], turns: Turns) -> None:
        self._pending, self._turns = pending, turns

    def wait(self, deadline: float) -> list[int]:
        """The call's codes, its exception, or CallTimedOut once ``deadline`` passes (the call then goes on)."""
        try:
            return self._pending.wait(deadline)
        finally:
            self._turns.release()


class MooncakeClient:
    """A ``MooncakeDistributedStore`` of this process. ``on_joined`` runs once it has joined the pool; ``timed``,
    if given, receives each transfer's ``turn`` (waiting for one of ``max_transfers``), ``start`` (from a worker
    taking the call to its thread running it) and ``transfer`` (the engine's call, late ones included) seconds."""

    def __init__(self, config: MooncakeTierConfig, calls: DeadlineCalls, on_joined: Callable[[], None],
                 timed: StageTimer | None = None) -> None:
        _engine_env(config)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ConfigError(
                "the mooncake tier needs Mooncake Store: pip install 'kvtier[mooncake-cpu]' (or "
                f"'kvtier[mooncake]' with CUDA) and apt-get install libibverbs1 ({exc})") from None
        if config.segment_device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"mooncake segment_device {config.segment_device}: CUDA is not available here")
        self._config, self._calls, self._on_joined = config, calls, on_joined
        self._timed: StageTimer = timed or (lambda op, stage, seconds: None)
        self._store = MooncakeDistributedStore()
        self.segment_bytes = segment_size(config, _free_memory(config.segment_device))
        self.joined = False
        self._joining = threading.Lock()  # one join attempt at a time
        self._transfers = Turns(config.max_transfers)  # loads ahead of saves

    # -- joining the pool ----------------------------------------------------------------------------------
    def join(self, deadline: float) -> bool:
        """One attempt to join the pool (none if another is under way); True once joined.

        Mooncake's ``setup`` holds the GIL, and against an absent master it retries for about 90 s, which would
        freeze the whole process. So it is called only once the master and its metadata server answer within
        ``deadline``; then it takes milliseconds."""
        if self.joined or not self._joining.acquire(blocking=False):
            return self.joined
        try:
            if not self._master_answers(deadline):
                return False
            code = self._setup()
            if code != Code.OK:
                log.warning("mooncake: cannot join the pool at %s (code %d)", self._config.master_address, code)
                return False
            self.joined = True
            log.info("mooncake: joined the pool at %s, contributing %d MiB", self._config.master_address,
                     self.segment_bytes >> 20)
        finally:
            self._joining.release()
        self._on_joined()
        return True

    def _master_answers(self, deadline: float) -> bool:
        config = self._config
        try:
            timeout = max(0.01, deadline - monotonic())
            with socket.create_connection(master_host_port(config), timeout=timeout):
                pass
            if config.metadata_server.startswith("http"):
                probe = f"{config.metadata_server}?key=kvtier-probe"
                try:
                    urllib.request.urlopen(probe, timeout=max(0.01, deadline - monotonic())).close()
                except urllib.error.HTTPError as exc:  # 404: up, and nothing under the probe key
                    return exc.code == 404
        except (OSError, ValueError):
            return False
        return True

    def _setup(self) -> int:
        config, device = self._config, self._config.segment_device
        if device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(device))  # a VRAM-segment build allocates on this thread's device
            free_before = _free_memory(device)
        code = self._store.setup(
            advertised_hostname(config), config.metadata_server, self.segment_bytes, ENGINE_LOCAL_BUFFER_BYTES,
            config.protocol.value, "", config.master_address)
        if code == Code.OK and device.startswith("cuda") and free_before - _free_memory(device) < self.segment_bytes:
            self._store.close()
            raise ConfigError(f"this Mooncake build put the segment in host memory, not on {device}: "
                              "segment_device needs Mooncake built with USE_VRAM_SEGMENT=ON")
        return code

    # -- the calls -----------------------------------------------------------------------------------------
    def _run(self, fn: Callable[..., T], *args: Any, deadline: float,
             on_late: Callable[[Any], None] | None = None) -> T:
        return self._calls.run(_guarded(fn), *args, deadline=deadline, on_late=on_late)

    def exists(self, keys: list[str], deadline: float) -> list[int]:
        """Per key: 1 present, 0 absent, negative an error code."""
        return self._run(self._store.batch_is_exist, keys, deadline=deadline)

    def sizes(self, keys: list[str], deadline: float) -> list[int | None]:
        """Each value's size from its first in-memory replica; None where there is none."""
        replicas = self._run(self._store.batch_get_replica_desc, keys, deadline=deadline)
        out: list[int | None] = []
        for key in keys:
            size = None
            for replica in replicas.get(key, ()):
                if replica.is_memory_replica():
                    size = replica.get_memory_descriptor().buffer_descriptor.size
                    break
            out.append(size)
        return out

    def get_into(self, keys: list[str], ptrs: list[int], sizes: list[int], deadline: float,
                 on_late: Callable[[Any], None]) -> list[int]:
        """Per key: the bytes written at its address, or a negative error code."""
        return self._transfer("get", self._store.batch_get_into, keys, ptrs, sizes, deadline, on_late)

    def start_put(self, keys: list[str], ptrs: list[int], sizes: list[int], deadline: float,
                  on_end: Callable[[], None]) -> Moving:
        """Start a put (once one of ``max_transfers`` turns is free, CallNotStarted if none is before
        ``deadline``) and return at once; ``Moving.wait`` gives per key 0 stored (or already there), or a negative
        error code. ``on_end`` runs on the worker when the engine's call ends, late or not (where the caller's
        buffer is released), and only then: not when the call never started."""
        return self._start("put", self._store.batch_put_from, keys, ptrs, sizes, deadline, on_end=on_end)

    def _transfer(self, op: str, fn: Callable[..., list[int]], keys: list[str], ptrs: list[int], sizes: list[int],
                  deadline: float, on_late: Callable[[Any], None]) -> list[int]:
        """A batch that moves bytes, once one of ``max_transfers`` turns is free, gets ahead of puts (turns.py;
        CallNotStarted if none is before ``deadline``). The turn ends when the caller stops waiting, so a call
        stuck on a frozen peer holds it up to its deadline, not for as long as the engine takes to give up."""
        return self._start(op, fn, keys, ptrs, sizes, deadline, on_late=on_late).wait(deadline)

    def _start(self, op: str, fn: Callable[..., list[int]], keys: list[str], ptrs: list[int], sizes: list[int],
               deadline: float, on_late: Callable[[Any], None] | None = None,
               on_end: Callable[[], None] | None = None) -> Moving:
        asked = monotonic()
        turn = self._transfers.acquire(op == "get", max(0.0, deadline - asked))
        self._timed(op, "turn", monotonic() - asked)
        if not turn:
            raise CallNotStarted(f"{fn.__name__}: other transfers of this tier held every turn until the deadline")

        def ended(call: Pending[Any]) -> None:
            self._timed(op, "start", call.started - call.submitted)
            self._timed(op, "transfer", call.ended - call.started)
            if on_end is not None:
                on_end()

        try:
            pending = self._calls.submit(_guarded(fn), keys, ptrs, sizes, deadline=deadline, on_late=on_late,
                                         on_end=ended)
        except BaseException:
            self._transfers.release()
            raise
        return Moving(pending, self._transfers)

    def remove(self, keys: Sequence[str], deadline: float) -> list[int]:
        # force: a read's lease (10 s by default) would refuse the removal of a value that just failed its
        # checksum; a reader racing the removal gets bytes that fail verification, i.e. a miss
        return self._run(self._store.batch_remove, list(keys), True, deadline=deadline)

    def remove_matching(self, regex: str, deadline: float) -> int:
        """Remove every key matching ``regex`` (Mooncake's ``remove_by_regex``, forced past read leases): the
        number removed, negative for an error code."""
        return self._run(self._store.remove_by_regex, regex, True, deadline=deadline)

    def register(self, ptr: int, nbytes: int, keep: object, deadline: float) -> int:
        """Register memory for zero-copy transfers; ``keep`` (the memory's owner) stays alive until a late
        registration has been undone."""
        def undo(code: int | None, keep: object = keep) -> None:
            if code == Code.OK:
                self._store.unregister_buffer(ptr)

        return self._run(self._store.register_buffer, ptr, nbytes, deadline=deadline, on_late=undo)

    def close(self) -> None:
        """Leave the pool: this replica's segment, and the values in it, go at once. Mooncake holds the GIL
        while it stops its heartbeat thread (about a second)."""
        with self._joining:
            if self.joined:
                self.joined = False
                self._store.close()
