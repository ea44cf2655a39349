"""A vLLM replica's device prefix cache, as vLLM v1's block pool keeps it.

vLLM caches KV in fixed blocks of ``block_size`` tokens, each full block keyed by a hash chained through its
predecessors. A running request holds its blocks. When it finishes, its blocks are freed last block first:
those caching a full block go to the back of the free queue, so a prompt's tail is evicted before its head;
those caching nothing (the partial last block) go to the front, to be reused first. A new request takes the
longest chain of its blocks the cache holds (out of the free queue, if there), then allocates the rest from
the front of the free queue, evicting whatever those blocks cached; it starts only if the pool can hold it
whole. tests/integrations/test_vllm_device_model.py runs the same requests through vLLM's own
``KVCacheManager`` and checks every hit and every refusal.

What the simulator does with it (kvtier.apps.sim.replay): a request is allocated whole when it arrives and
holds its blocks until it ends. vLLM allocates as chunked prefill proceeds and leaves a request the pool
cannot hold waiting for room; here such a request finds its hit and caches nothing. A block filled by output
tokens caches nothing here (vLLM caches it too).
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence

#: the tier name the router's view and the hit counts give a replica's device cache
DEVICE = "device"


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained keys of the full blocks of ``tokens`` (a prefix's keys are a prefix of the longer prompt's)."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(int(t).to_bytes(4, "little") for t in tokens[start:start + block_size]))
        parent = digest.digest()
        keys.append(parent)
    return keys


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


class FleetDevices:
    """Every replica's :class:`DevicePool` of ``blocks`` blocks as vLLM counts them (``--num-gpu-blocks-override``;
    one is vLLM's null block, never cached), and when each running request gives its blocks back.

    Time only moves forward: :meth:`settle` releases the requests that ended by ``now``, in the order they
    ended, before anything new is looked up or admitted at ``now``."""

    def __init__(self, replicas: int, blocks: int, block_size: int) -> None:
        self.pools = [DevicePool(max(blocks - 1, 0)) for _ in range(replicas)]
        self.block_size = block_size
        self._ends: list[tuple[float, int, int, list[int]]] = []  # (end, sequence, replica, held blocks)
        self._sequence = 0

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        return block_keys(tokens, self.block_size)

    def settle(self, now: float) -> None:
        while self._ends and self._ends[0][0] <= now:
            _, _, replica, held = heapq.heappop(self._ends)
            self.pools[replica].release(held)

    def cached_tokens(self, keys: Sequence[bytes], prompt_tokens: int) -> list[int]:
        """Per replica, the prompt's tokens a request arriving now would find on its device (whole blocks, never
        the prompt's last token: vLLM computes at least one)."""
        most = max(prompt_tokens - 1, 0) // self.block_size
        return [min(pool.cached_blocks(keys), most) * self.block_size for pool in self.pools]

    def start(self, replica: int, keys: Sequence[bytes], prompt_tokens: int,
              output_tokens: int = 0) -> tuple[int, list[int]]:
        """A request starts on ``replica``: the tokens its device held (as :meth:`cached_tokens`), and the blocks
        it holds until :meth:`end_at` (room for its prompt and ``output_tokens``)."""
        most = max(prompt_tokens - 1, 0) // self.block_size
        blocks = -(-(prompt_tokens + output_tokens) // self.block_size)
        hit, held = self.pools[replica].admit(keys, blocks, most)
        return hit * self.block_size, held

    def end_at(self, replica: int, held: list[int], end_s: float) -> None:
        """The request holding ``held`` on ``replica`` ends at ``end_s`` (released by the first later settle)."""
        heapq.heappush(self._ends, (end_s, self._sequence, replica, held))
        self._sequence += 1
