"""vLLM's own block accounting, asked for the scheduler side's admission of asynchronous loads (``_room_for``).

With vLLM's hybrid KV cache manager a request holds blocks in every KV cache group: a full-attention group one per
``block_size`` tokens of its prefix, a sliding-window group only those inside the window (the rest are the null
block), a Mamba group its state blocks. So what a request needs is asked of vLLM's KV cache coordinator
(``get_num_blocks_to_allocate``, summed over the groups), given the state the request will be in, rather than
counted here from its length.

Three counts feed the admission (scheduler.py says the rule):

* ``park``: the blocks vLLM allocates to park a load of tokens ``[computed, end)`` (``allocate_slots`` with no new
  token, the load as external tokens: in a sliding-window group only the window before ``end``);
* ``lack``: the blocks that parked request then still needs to run its prompt and first output token;
* ``step``: the blocks a running request needs for its next ``block_size`` tokens: one in every group that
  holds its recent tokens (those it crosses a block boundary in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: vLLM's null block (``BlockPool``): what a sliding-window group holds for the blocks that left the window
_NULL_BLOCK = 0


class Room:
    """Counts over ``manager``, vLLM's ``KVCacheManager`` (bound to the connector by vLLM)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def free(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    def usable(self) -> int:
        """The blocks requests can hold at all: the pool less its null block."""
        return self.manager.block_pool.num_gpu_blocks - 1

    def _count(self, request: Request, num_tokens: int, hit: tuple, local: int, computed: int) -> int:
        """The blocks vLLM would allocate for ``request`` to hold ``num_tokens`` tokens, ``computed`` of them
        already computed (``local`` of those from vLLM's own prefix cache, in ``hit``), over every group."""
        manager = self.manager
        num_tokens = min(num_tokens, manager.max_model_len)
        return manager.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id, num_tokens=num_tokens, new_computed_blocks=hit, num_encoder_tokens=0,
            total_computed_tokens=computed, num_local_computed_tokens=local, num_tokens_main_model=num_tokens,
            prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1))

    def _local_hit(self, request: Request, local: int) -> tuple[tuple, int]:
        """vLLM's own prefix-cache blocks for the request's first ``local`` tokens, per group, as the scheduler
        hands them to ``allocate_slots`` (read-only: nothing is touched); none if the cache no longer holds them
        all (then every block is counted as new, an over-count)."""
        manager = self.manager
        empty = manager.empty_kv_cache_blocks
        if local <= 0 or not manager.prefix_cache_lookup_enabled(request):
            return empty.blocks, 0
        blocks, found, _ = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        if found < local:
            return empty.blocks, 0
        return manager.truncate_computed_blocks(manager.create_kv_cache_blocks(blocks), local).blocks, local

    def park_and_lack(self, request: Request, computed: int, end: int) -> tuple[int, int]:
        """``(park, lack)`` for a load of ``[computed, end)`` into a request that holds no blocks yet, ``computed``
        of its tokens hit in vLLM's own prefix cache."""
        hit, local = self._local_hit(request, computed)
        park = self._count(request, end, hit, local, end)
        run = self._count(request, request.num_tokens + 1, hit, local, end)
        return park, max(run - park, 0)

    def lack(self, request: Request, end: int) -> int:
        """What a request parked with its load up to ``end`` (blocks allocated) lacks to run."""
        empty = self.manager.empty_kv_cache_blocks.blocks
        return self._count(request, request.num_tokens + 1, empty, end, end)

    def step(self, request: Request, scheduled: int, tokens: int) -> int:
        """The blocks a running request needs for its next ``tokens`` tokens (at most up to its last) beyond the
        ``scheduled`` ones of the step being scheduled (vLLM schedules running requests, allocating their blocks,
        before it admits waiting ones)."""
        from vllm.v1.request import RequestStatus

        if request.status != RequestStatus.RUNNING:  # preempted since: it holds and needs nothing now
            return 0
        empty = self.manager.empty_kv_cache_blocks.blocks
        done = request.num_computed_tokens
        last = max(request.num_prompt_tokens + request.max_tokens, request.num_tokens)
        return self._count(request, min(done + scheduled + tokens, last), empty, done, done)

    @staticmethod
    def held(tables: tuple[list[int], ...]) -> int:
        """The real blocks in a request's block tables (the null block stands for none)."""
        return sum(1 for table in tables for block in table if block != _NULL_BLOCK)

    def admits(self, park: int, lack: int, parked: list[tuple[int, int]], steps: int) -> bool | None:
        """Whether to promise a load that parks with ``park`` blocks and then lacks ``lack`` to run: True (promise
        it), None (not now: ask again) or False (never: its prompt cannot fit beside its load; vLLM computes it).
        ``parked``: ``(held, lack)`` of each load promised and not running yet; ``steps``: what the running
        requests' next ``block_size`` tokens need.

        A load is promised only when the free blocks hold all of it (its park and its lack) beside what the
        parked loads lack and the running requests' next ``block_size`` tokens (a block in each group they
        decode into, as vLLM counts it). So every load promised can run as soon as it lands (the parked loads
        never wait on each other: no deadlock), and none takes the block a running request decodes into next
        (no preemption for its sake): vLLM admits a request it computes itself on the same terms."""
        if park + lack > self.usable():
            return False
        if self.free() - sum(need for _, need in parked) - steps >= park + lack:
            return True
        return None
