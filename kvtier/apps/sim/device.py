"""A vLLM replica's device prefix cache, as vLLM v1's block pool keeps it.

vLLM caches KV in fixed blocks of ``block_size`` tokens, each full block keyed by a hash chained through its
predecessors. A running request holds its blocks. When it finishes, its blocks are freed last block first:
those caching a full block go to the back of the free queue, so a prompt's tail is evicted before its head;
those caching nothing (the partial last block) go to the front, to be reused first. A new request takes the
longest chain of its blocks the cache holds (out of the free queue, if there), then allocates the rest from
the front of the free queue, evicting whatever those blocks cached; it starts only if the pool can hold it
whole, else waits. tests/integrations/test_vllm_device_model.py runs the same requests through vLLM's own
``KVCacheManager`` and checks every hit, every wait and every admission.

What the simulator does with it (kvtier.apps.sim.replay, :class:`FleetDevices`): a request is allocated whole
when it starts and holds its blocks until it ends; one the pool cannot hold waits, first come first served, as
in vLLM's queue, and takes its blocks when room comes back (vLLM allocates as chunked prefill proceeds). The
hit a request counts is what the device held when it arrived. A block filled by output tokens caches nothing
here (vLLM caches it too).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.fleet.vllm_index import vllm_namespace

#: the tier name the router's view and the hit counts give a replica's device cache
DEVICE = "device"


class DevicePool:
    """One replica's device cache of ``blocks`` blocks (see the module docstring for what it models)."""

    def __init__(self, blocks: int) -> None:
        if blocks < 0:
            raise ValueError(f"a device holds a non-negative number of blocks, got {blocks}")
        self.blocks = blocks
        self._next_block = 0  # blocks never used yet: ids from here to ``blocks``
        self._key_of: dict[int, bytes] = {}  # block id -> the key it caches (full blocks only)
        self._cached: dict[bytes, dict[int, None]] = {}  # key -> the blocks caching it (the first one serves a hit)
        self._holders: dict[int, int] = {}  # block id -> running requests holding it
        self._free: OrderedDict[int, None] = OrderedDict()  # blocks nobody holds, in eviction order

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """Blocks of the longest prefix of ``keys`` the device holds now."""
        n = 0
        for key in keys:
            if key not in self._cached:
                break
            n += 1
        return n

    def admit(self, keys: Sequence[bytes], blocks: int, most_hit: int | None = None) -> tuple[int, list[int]]:
        """A request whose full blocks have ``keys`` starts, holding ``blocks`` blocks in all (its partial last
        block and the blocks its output fills too): returns its prefix hit in blocks (at most ``most_hit``) and
        the blocks it holds until :meth:`release`. A request the pool cannot hold whole takes nothing and
        holds nothing (vLLM would leave it waiting for room): the hit is what it would find."""
        hit = min(self.cached_blocks(keys), len(keys) if most_hit is None else most_hit)
        found = [next(iter(self._cached[key])) for key in keys[:hit]]
        free_found = sum(1 for block in found if not self._holders.get(block))
        if blocks - hit > (self.blocks - self._next_block) + len(self._free) - free_found:
            return hit, []
        for block in found:
            self._free.pop(block, None)
            self._holders[block] = self._holders.get(block, 0) + 1
        held = found
        for i in range(hit, blocks):
            block = self._allocate()
            self._holders[block] = 1
            if i < len(keys):  # a full block: cached under its key (beside any other block caching it)
                self._key_of[block] = keys[i]
                self._cached.setdefault(keys[i], {})[block] = None
            held.append(block)
        return hit, held

    def release(self, held: Sequence[int]) -> None:
        """A request ended: its cached blocks join the back of the free queue, its last block first; blocks that
        cache nothing go to the front, to be reused first (vLLM's ``BlockPool.free_blocks``)."""
        uncached: list[int] = []
        for block in reversed(held):
            count = self._holders.get(block, 0)
            if not count:
                continue
            self._holders[block] = count - 1
            if count > 1:
                continue
            if block in self._key_of:
                self._free[block] = None
            else:
                uncached.append(block)
        for block in reversed(uncached):
            self._free[block] = None
            self._free.move_to_end(block, last=False)

    def _allocate(self) -> int:
        if self._next_block < self.blocks:
            self._next_block += 1
            return self._next_block - 1
        block, _ = self._free.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:
            owners = self._cached[key]
            del owners[block]
            if not owners:
                del self._cached[key]
        return block


@dataclass
class Running:
    """A request on a replica's device: the blocks it holds, or, while it waits for room, what it will take."""

    replica: int
    keys: Sequence[bytes]
    blocks: int
    most_hit: int
    held: list[int] | None = None  # None: waiting for room
    end_s: float | None = None


class FleetDevices:
    """Every replica's :class:`DevicePool` of ``blocks`` blocks as vLLM counts them (``--num-gpu-blocks-override``;
    one is vLLM's null block, never cached), the requests waiting for room on each, and when each running
    request gives its blocks back.

    A request the pool cannot hold whole waits, first come first served, as in vLLM's queue: it takes its blocks
    when the requests ahead of it have and enough have been given back (what it finds on the device is counted
    when it arrives). Time only moves forward: :meth:`settle` releases the requests that ended by ``now``, in the
    order they ended, admitting waiting ones as room appears, before anything new is looked up at ``now``."""

    def __init__(self, replicas: int, blocks: int, block_size: int) -> None:
        self.pools = [DevicePool(max(blocks - 1, 0)) for _ in range(replicas)]
        self.block_size = block_size
        self._namespace = vllm_namespace(block_size)  # the router's keys of vLLM blocks: chained, full blocks only
        self._ends: list[tuple[float, int, Running]] = []  # (end, sequence, request)
        self._waiting: list[deque[Running]] = [deque() for _ in range(replicas)]
        self._sequence = 0

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """Chained keys of the full blocks of ``tokens`` (a prefix's keys are a prefix of the longer prompt's)."""
        return self._namespace.chunk_hashes(tokens)

    def settle(self, now: float) -> None:
        while self._ends and self._ends[0][0] <= now:
            end, _, request = heapq.heappop(self._ends)
            assert request.held is not None
            self.pools[request.replica].release(request.held)
            self._admit_waiting(request.replica, end)

    def cached_tokens(self, keys: Sequence[bytes], prompt_tokens: int) -> list[int]:
        """Per replica, the prompt's tokens a request arriving now would find on its device (whole blocks, never
        the prompt's last token: vLLM computes at least one)."""
        most = max(prompt_tokens - 1, 0) // self.block_size
        return [min(pool.cached_blocks(keys), most) * self.block_size for pool in self.pools]

    def start(self, replica: int, keys: Sequence[bytes], prompt_tokens: int,
              output_tokens: int = 0) -> tuple[int, Running]:
        """A request arrives on ``replica``: the tokens its device holds (as :meth:`cached_tokens`), and its place
        there, running or waiting for room, until :meth:`end_at` (room for its prompt and ``output_tokens``)."""
        most = max(prompt_tokens - 1, 0) // self.block_size
        request = Running(replica, keys, -(-(prompt_tokens + output_tokens) // self.block_size), most)
        hit = min(self.pools[replica].cached_blocks(keys), most)
        if request.blocks == 0 or request.blocks > self.pools[replica].blocks:
            request.held = []  # holds nothing, or never fits (vLLM refuses it): nothing is cached, nobody waits
        elif not self._waiting[replica]:
            _, held = self.pools[replica].admit(keys, request.blocks, most)
            request.held = held or None
        if request.held is None:
            self._waiting[replica].append(request)
        return hit * self.block_size, request

    def end_at(self, request: Running, end_s: float) -> None:
        """``request`` ends at ``end_s``: it gives its blocks back at the first settle from then on (one still
        waiting then takes its blocks when its turn comes, and gives them back at once)."""
        request.end_s = end_s
        if request.held is not None:
            self._push_end(request, end_s)

    def _push_end(self, request: Running, end_s: float) -> None:
        heapq.heappush(self._ends, (end_s, self._sequence, request))
        self._sequence += 1

    def _admit_waiting(self, replica: int, now: float) -> None:
        waiting, pool = self._waiting[replica], self.pools[replica]
        while waiting:
            request = waiting[0]
            _, held = pool.admit(request.keys, request.blocks, request.most_hit)
            if not held:
                return
            waiting.popleft()
            request.held = held
            if request.end_s is not None:
                self._push_end(request, max(request.end_s, now))
