"""Scheduler side of the connector: decides what to load and what to save, never touches KV.

* ``matched_tokens`` asks the workers (lookup socket) how much of a request kvtier holds, and promises vLLM
  the part beyond its own prefix-cache hit, always leaving at least one token for vLLM to compute.
  A request whose chunks are still being saved by an earlier request waits (``None``) so it gets the hit.
* After vLLM allocated blocks, the promise becomes a :class:`LoadSpec` in the next step's metadata; the
  worker loads synchronously, before the forward pass, or reports the blocks it could not fill.
* When a request finishes, its computed full chunks that kvtier did not already hold become a
  :class:`SaveSpec`; vLLM keeps the blocks until the worker reports the save finished.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import TYPE_CHECKING

from kvtier.base.keys import ChunkHash, chunk_hashes
from kvtier.integrations.vllm.lookup import LookupClient
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec, pack_tokens

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def request_salt(request: Request) -> bytes:
    """What separates one request's KV from another's with the same tokens: the LoRA and the cache salt."""
    lora = request.lora_request.lora_name if request.lora_request is not None else ""
    salt = request.cache_salt or ""
    return f"lora={lora}\0salt={salt}".encode() if lora or salt else b""


class SchedulerSide:
    def __init__(self, chunk_size: int, block_size: int, lookup: LookupClient) -> None:
        self.chunk_size, self.block_size = chunk_size, block_size
        self.lookup = lookup
        self._plans: dict[str, tuple[int, int]] = {}  # req_id -> (vLLM's hit, end of kvtier's)
        self._hits: dict[str, int] = {}  # req_id -> tokens kvtier held when the request was scheduled
        self._loads: dict[str, tuple[Request, int, int]] = {}
        self._saves: list[SaveSpec] = []
        self._saving: dict[str, list[ChunkHash]] = {}
        self._saving_keys: Counter[ChunkHash] = Counter()
        self._loading_blocks: dict[str, set[int]] = {}  # req_id -> blocks a load was to fill

    def _keys(self, tokens: list[int], salt: bytes) -> list[ChunkHash]:
        """Scheduler-local chunk identities, only compared with each other (not kvtier's keys)."""
        return chunk_hashes(ChunkHash(hashlib.sha256(b"kvtier/vllm\0" + salt).digest()), tokens, self.chunk_size)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = list(request.all_token_ids)
        salt = request_salt(request)
        keys = self._keys(tokens, salt)
        if not keys:
            return 0, False
        beyond_vllm = keys[num_computed_tokens // self.chunk_size :]
        if self._saving_keys and any(k in self._saving_keys for k in beyond_vllm):
            return None, False  # chunks vLLM lacks are being saved: ask again next step, then hit
        hit = self.lookup.lookup(tokens[: len(keys) * self.chunk_size], salt)
        self._hits[request.request_id] = hit
        end = min(hit, request.num_tokens - 1)  # vLLM must compute at least one token
        if end <= num_computed_tokens:
            return 0, False
        self._plans[request.request_id] = (num_computed_tokens, end)
        return end - num_computed_tokens, False

    def after_alloc(self, request: Request, num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, None)
        if num_external_tokens <= 0 or plan is None:
            return
        first = plan[0]
        self._loads[request.request_id] = (request, first, first + num_external_tokens)

    def build_meta(self, out: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata(saves=self._saves)
        self._saves = []
        for new in out.scheduled_new_reqs:
            if new.req_id in self._loads:
                meta.loads.append(self._load_spec(new.req_id, new.block_ids[0]))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._loads and req_id in cached.resumed_req_ids and cached.new_block_ids[i]:
                meta.loads.append(self._load_spec(req_id, cached.new_block_ids[i][0]))
        self._loads.clear()
        self._plans.clear()
        return meta

    def _load_spec(self, req_id: str, block_ids: list[int]) -> LoadSpec:
        request, first, end = self._loads[req_id]
        size, bs = self.chunk_size, self.block_size
        self._loading_blocks[req_id] = set(block_ids[first // bs : -(-end // bs)])
        read_end = -(-end // size) * size
        tokens = pack_tokens(list(request.all_token_ids[:read_end]))
        return LoadSpec(req_id, tokens, request_salt(request), list(block_ids), first, end)

    def finished(self, request: Request, block_ids: list[int]) -> bool:
        """Order a save of the request's new full chunks; True when vLLM must keep its blocks for it."""
        hit = self._hits.pop(request.request_id, 0)
        self._plans.pop(request.request_id, None)
        self._loading_blocks.pop(request.request_id, None)
        n = min(request.num_computed_tokens, len(block_ids) * self.block_size)
        n -= n % self.chunk_size
        if n <= hit:
            return False
        tokens = list(request.all_token_ids[:n])
        salt = request_salt(request)
        keys = self._keys(tokens, salt)
        self._saving[request.request_id] = keys
        self._saving_keys.update(keys)
        self._saves.append(SaveSpec(request.request_id, pack_tokens(tokens), salt, list(block_ids)))
        return True

    def load_failed(self, block_ids: set[int]) -> None:
        """Blocks a worker could not fill: their requests must save again what kvtier lost (it deleted
        chunks that failed verification), so forget those requests' hits."""
        for req_id, blocks in self._loading_blocks.items():
            if blocks & block_ids:
                self._hits[req_id] = 0

    def saves_done(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._saving_keys.subtract(self._saving.pop(req_id, ()))
        self._saving_keys = +self._saving_keys  # drop zero counts
