"""Prefill/decode disaggregation through kvtier's shared tiers: vLLM 0.32's ``kv_transfer_params`` protocol.

The protocol is the one vLLM's own P/D connectors (NIXL, Mooncake) speak, so any proxy that drives them drives
this one (``kvtier route --prefill ... --decode ...`` is one):

1. The proxy sends the request to a **prefill** instance with ``max_tokens: 1`` and
   ``kv_transfer_params: {"do_remote_decode": true}``. kvtier stores every full chunk of the prompt under its
   usual keys (a later request with the same prefix, on any instance, hits them) and the whole blocks of the
   partial last chunk (up to the block of the prompt's last token) under a key of its own, derived from the chain and a nonce drawn for this request (``TAIL_DOMAIN``): no
   other prompt can produce it. The store runs in ``wait_for_save`` of the step that computes the prompt's
   last token, so it is over before vLLM answers. ``request_finished`` then returns the params for the decode
   side: ``{"do_remote_prefill": true, "do_remote_decode": false, "kvtier_pd": {"nonce": HEX, "prompt_tokens":
   N}}``.
2. The proxy sends the same request to a **decode** instance with those params. kvtier promises vLLM the
   prompt's whole blocks before the block of its last token as an asynchronous load (the request waits in
   ``WAITING_FOR_REMOTE_KVS``), loads the full chunks and then the tail, verified like every load; vLLM computes
   the prompt's last block (at most a block of tokens, at least one) and decodes.
   Whatever does not arrive verified (the store was down, a chunk evicted or corrupt, the tail expired) is
   reported block by block and vLLM recomputes it: the answer is the same, only slower.

Params kvtier did not write (another connector's, or ``kvtier_pd`` malformed) make a decode request an
ordinary one: it is looked up and loaded as any other prompt (counted in ``ignored``, logged once).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PD_KEY = "kvtier_pd"  #: kvtier's own entry in ``kv_transfer_params``
NONCE_BYTES = 16
#: How long a prompt's partial last chunk is kept for its decode instance (seconds): it serves that one
#: request, which loads it right after the prefill answered.
TAIL_TTL_S = 600.0


def loadable_tokens(n_prompt: int, block_size: int) -> int:
    """The prompt tokens a decode instance loads: its whole blocks before the block holding its last token (a
    partly filled block is never copied, kvtier.integrations.vllm.transfer says why; vLLM computes the last
    block, at least one token, itself)."""
    return (n_prompt - 1) // block_size * block_size if n_prompt > 0 else 0


@dataclass(frozen=True)
class DecodeTicket:
    """What a decode request's params say the prefill stored: ``prompt_tokens`` of the prompt, its partial last
    chunk under ``nonce``."""

    nonce: bytes
    prompt_tokens: int


def _params(request: Request) -> dict[str, Any] | None:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else None


def wants_remote_decode(request: Request) -> bool:
    """Whether the request is a prefill for another instance's decode (``do_remote_decode``)."""
    params = _params(request)
    return params is not None and params.get("do_remote_decode") is True


def decode_ticket(request: Request) -> DecodeTicket | None:
    """The ticket of a decode request whose prefill kvtier ran; None for any other request. ValueError for params
    that ask for a remote prefill with a malformed ``kvtier_pd`` entry."""
    params = _params(request)
    if params is None or params.get("do_remote_prefill") is not True:
        return None
    ours = params.get(PD_KEY)
    if ours is None:
        return None
    if not isinstance(ours, dict):
        raise ValueError(f"kv_transfer_params.{PD_KEY} must be an object, got {type(ours).__name__}")
    nonce, n = ours.get("nonce"), ours.get("prompt_tokens")
    try:
        raw = bytes.fromhex(nonce) if isinstance(nonce, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != NONCE_BYTES:
        raise ValueError(f"kv_transfer_params.{PD_KEY}.nonce must be {NONCE_BYTES * 2} hex digits")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"kv_transfer_params.{PD_KEY}.prompt_tokens must be a positive integer, got {n!r}")
    return DecodeTicket(raw, n)


class PDRequests:
    """The scheduler's record of the requests taking part in a disaggregated prefill or decode.

    ``prefills``: prefill requests and their nonce, until they finish; ``stored``: those whose store was
    ordered (the step computing their last prompt token was scheduled); ``decodes``: decode requests whose
    load was not planned yet (one load per request: a request preempted later is an ordinary one)."""

    def __init__(self) -> None:
        self.prefills: dict[str, bytes] = {}
        self.stored: set[str] = set()
        self.decodes: dict[str, DecodeTicket] = {}
        self.ignored = 0  #: decode requests whose kvtier params were malformed (served as ordinary requests)

    def new_request(self, request: Request) -> None:
        req_id = request.request_id
        if wants_remote_decode(request):
            self.prefills[req_id] = secrets.token_bytes(NONCE_BYTES)
            return
        try:
            ticket = decode_ticket(request)
        except ValueError as exc:
            if not self.ignored:
                log.warning("kvtier: request %s: %s; served as an ordinary request (logged once)", req_id, exc)
            self.ignored += 1
            return
        if ticket is not None and ticket.prompt_tokens == request.num_prompt_tokens:
            self.decodes[req_id] = ticket

    def finished(self, request: Request, stored_normally: bool) -> dict[str, Any] | None:
        """The params a finished prefill hands its decode instance (None for any other request, and for a
        prefill whose store was never ordered or that did not end normally: aborted, preempted for good)."""
        req_id = request.request_id
        self.decodes.pop(req_id, None)
        nonce = self.prefills.pop(req_id, None)
        if nonce is None or req_id not in self.stored:
            return None
        self.stored.discard(req_id)
        if not stored_normally:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False,
                PD_KEY: {"nonce": nonce.hex(), "prompt_tokens": request.num_prompt_tokens}}
