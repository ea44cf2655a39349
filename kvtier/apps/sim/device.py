"""A vLLM replica's device prefix cache, as vLLM v1's block pool keeps it.

vLLM caches KV in fixed blocks of ``block_size`` tokens, each full block keyed by a hash chained through its
predecessors. A running request holds its blocks; when it finishes, its blocks go to the back of a free queue
*last block first*, so a prompt's tail is evicted before its head. A new request first takes the longest
chain of its blocks the cache still holds (out of the free queue, if there), then allocates the rest from the
front of the free queue, evicting whatever those blocks held. What this model keeps of that:

* capacity in blocks; a block's key is the chain of its tokens (the router's own keys are not needed);
* the prefix hit (whole blocks, in order), pinning while a request runs, the free queue's order on release;
* eviction only when a block is allocated, so a request's blocks stay until others need the room.

What it leaves out: a request is allocated whole when it arrives (vLLM allocates as chunked prefill proceeds,
and queues or preempts when the pool is short; here a request that does not fit takes what is free and the
rest of its blocks are not cached), and the block that holds the last prompt token is never a hit (vLLM
recomputes at least one token; :meth:`admit` reports whole blocks, the caller caps the hit).
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
        self._never_used = blocks
        self._holders: dict[bytes, int] = {}  # cached block -> requests holding it (0: in the free queue)
        self._free: OrderedDict[bytes, None] = OrderedDict()  # cached blocks nobody holds, front evicted first

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """Blocks of the longest prefix of ``keys`` the device holds now."""
        n = 0
        for key in keys:
            if key not in self._holders:
                break
            n += 1
        return n

    def admit(self, keys: Sequence[bytes]) -> tuple[int, list[bytes]]:
        """A request with these block keys starts: returns its prefix hit in blocks and the blocks it now holds
        (pass them to :meth:`release` when it ends)."""
        hit = self.cached_blocks(keys)
        held = list(keys[:hit])
        for key in held:
            self._hold(key)
        for key in keys[hit:]:
            if key in self._holders:  # a block repeated further into the same prompt
                self._hold(key)
            elif not self._allocate():
                break
            else:
                self._holders[key] = 1
            held.append(key)
        return hit, held

    def release(self, held: Sequence[bytes]) -> None:
        """A request ended: its blocks join the back of the free queue, its last block first."""
        for key in reversed(held):
            count = self._holders.get(key)
            if count is None or count == 0:
                continue
            self._holders[key] = count - 1
            if count == 1:
                self._free[key] = None

    def _hold(self, key: bytes) -> None:
        if self._holders[key] == 0:
            del self._free[key]
        self._holders[key] += 1

    def _allocate(self) -> bool:
        if self._never_used:
            self._never_used -= 1
            return True
        if not self._free:
            return False
        evicted, _ = self._free.popitem(last=False)
        del self._holders[evicted]
        return True


class FleetDevices:
    """Every replica's :class:`DevicePool`, and when each running request gives its blocks back.

    Time only moves forward: :meth:`settle` releases the requests that ended by ``now``, in the order they
    ended, before anything new is looked up or admitted at ``now``."""

    def __init__(self, replicas: int, blocks: int, block_size: int) -> None:
        self.pools = [DevicePool(blocks) for _ in range(replicas)]
        self.block_size = block_size
        self._ends: list[tuple[float, int, int, list[bytes]]] = []  # (end, sequence, replica, held blocks)
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

    def start(self, replica: int, keys: Sequence[bytes], prompt_tokens: int) -> tuple[int, list[bytes]]:
        """A request starts on ``replica``: the tokens its device held (as :meth:`cached_tokens`), and the blocks
        it holds until :meth:`end_at`."""
        hit, held = self.pools[replica].admit(keys)
        return min(hit, max(prompt_tokens - 1, 0) // self.block_size) * self.block_size, held

    def end_at(self, replica: int, held: list[bytes], end_s: float) -> None:
        """The request holding ``held`` on ``replica`` ends at ``end_s`` (released by the first later settle)."""
        heapq.heappush(self._ends, (end_s, self._sequence, replica, held))
        self._sequence += 1
