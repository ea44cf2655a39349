"""The scheduler side's part in prefill/decode disaggregation (pd.py says the protocol): promising a decode its
prompt's stored blocks, and ordering a prefill's whole prompt stored. A mixin of ``SchedulerSide``, kept apart so
that each module stays small; it reads and writes the scheduler's request state as its own methods do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.integrations.vllm.metadata import KVTierMetadata, TransferSpec, pack_extras, pack_tokens
from kvtier.integrations.vllm.pd import loadable_tokens

if TYPE_CHECKING:
    from vllm.v1.request import Request


class PDScheduling:
    """``SchedulerSide``'s P/D steps (see its attributes)."""

    def _remote_prefill(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """A disaggregated decode: the prompt its prefill instance stored, up to the block of its last token
        (pd.loadable_tokens: whole blocks only; vLLM computes the last block), promised as an asynchronous
        load (what does not arrive verified is recomputed); "ask again" as for any load (``matched_tokens``)."""
        inputs = self._request_inputs(request)
        end = loadable_tokens(request.num_prompt_tokens, self.block_size)
        if inputs is None or end <= num_computed_tokens:
            return 0, False
        if self._in_flight:
            keys = self._keys(self._usable(request), inputs)[num_computed_tokens // self.chunk_size :]
            if any(k in self._in_flight for k in keys):
                return None, False
        room = self._room_for(request, num_computed_tokens, end)
        if not room:
            return (None if room is None else 0), False
        self._hits[request.request_id] = end - end % self.chunk_size
        self._plans[request.request_id] = (num_computed_tokens, end)
        return end - num_computed_tokens, True

    def _order_transfer(self, request: Request, n_scheduled: int, meta: KVTierMetadata) -> None:
        """A disaggregated prefill: its whole prompt stored in the step that computes its last token (and no save
        job before: they would store the same chunks); nothing more is saved when it finishes."""
        req_id = request.request_id
        inputs = self._request_inputs(request)
        n = request.num_prompt_tokens
        if req_id in self.pd.stored or inputs is None or request.num_computed_tokens + n_scheduled < n:
            return
        self.pd.stored.add(req_id)
        self._ordered[req_id] = n - n % self.chunk_size
        salt, extras = inputs
        meta.transfers.append(TransferSpec(req_id, pack_tokens(list(request.all_token_ids[:n])), salt,
                                           list(self.kv_cache_manager.get_block_ids(req_id)[self.groups.full]),
                                           self.pd.prefills[req_id], self._ttl(request), pack_extras(extras)))
