"""The pieces of prefill/decode disaggregation without an engine: the params each side reads and writes, and a
prompt stored from one paged cache and loaded into another through a real cache, the partial last chunk included.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvtier import CacheConfig, KVCache  # noqa: E402
from kvtier.integrations.vllm.loader import retrieve_spec  # noqa: E402
from kvtier.integrations.vllm.metadata import LoadSpec, TransferSpec, pack_tokens  # noqa: E402
from kvtier.integrations.vllm.paged import PagedKV, PagedSink  # noqa: E402
from kvtier.integrations.vllm.pd import PD_KEY, PDRequests, decode_ticket, loadable_tokens  # noqa: E402
from kvtier.integrations.vllm.transfer import store_transfer  # noqa: E402

BLOCKS, HEADS, BS, DIM, LAYERS, CHUNK = 16, 2, 32, 16, 2, 64
PROMPT = list(range(1000, 1190))  # two full chunks and a tail of 62 tokens (a block and a part)
LOADED = 160  # the decode side's share: the whole blocks before the block of the prompt's last token


def request(params, n: int = len(PROMPT), req_id: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, num_prompt_tokens=n)


def test_a_prefill_hands_its_decode_a_nonce_and_the_prompt_length():
    pd = PDRequests()
    prefill = request({"do_remote_decode": True})
    pd.new_request(prefill)
    assert pd.finished(prefill, stored_normally=True) is None  # its store was never ordered
    pd.new_request(prefill)
    pd.stored.add("r")
    params = pd.finished(prefill, stored_normally=True)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    ticket = decode_ticket(request(params))
    assert ticket.prompt_tokens == len(PROMPT) and len(ticket.nonce) == 16
    pd.new_request(request(params, req_id="d"))
    assert pd.decodes["d"] == ticket
    pd.new_request(request(params, n=len(PROMPT) + 1, req_id="e"))  # another prompt: an ordinary request
    assert "e" not in pd.decodes


@pytest.mark.parametrize("ours", ["x", {"nonce": "zz" * 16, "prompt_tokens": 5}, {"nonce": "ab", "prompt_tokens": 5},
                                  {"nonce": "ab" * 16, "prompt_tokens": 0}, {"nonce": "ab" * 16, "prompt_tokens": True}])
def test_malformed_params_make_an_ordinary_request(ours):
    with pytest.raises(ValueError, match=PD_KEY):
        decode_ticket(request({"do_remote_prefill": True, PD_KEY: ours}))
    pd = PDRequests()
    pd.new_request(request({"do_remote_prefill": True, PD_KEY: ours}))
    assert not pd.decodes and pd.ignored == 1


def test_other_connectors_params_are_not_ours():
    assert decode_ticket(request({"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1]})) is None
    assert decode_ticket(request(None)) is None


def paged(fill: bool) -> PagedKV:
    make = torch.randn if fill else torch.zeros
    return PagedKV([make(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)], BS, rows_split=True)


def rows(kv: PagedKV, blocks: list[int], n: int) -> torch.Tensor:
    """Canonical KV of the first ``n`` tokens held in ``blocks``."""
    return kv.gather(blocks, 0, -(-n // BS) * BS)[:, :, :n]


def test_a_prompt_travels_in_whole_blocks_and_its_tail_only_to_its_own_request():
    cache = KVCache(paged(False).spec, "m@1", CacheConfig(chunk_size=CHUNK))
    source, prefill_blocks = paged(True), [3, 7, 1, 9, 12, 14]
    nonce = b"n" * 16
    stored = store_transfer(cache, source, TransferSpec("p", pack_tokens(PROMPT), b"", prefill_blocks, nonce))
    assert stored == LOADED  # the full chunks, and of the tail its first whole block only
    assert loadable_tokens(len(PROMPT), BS) == LOADED
    decode_blocks = [0, 2, 4, 5, 6, 8]

    def load(tail_nonce: bytes) -> tuple[int, PagedKV]:
        target = paged(False)
        spec = LoadSpec("d", pack_tokens(PROMPT), b"", decode_blocks, 0, LOADED, 30.0, b"", tail_nonce=tail_nonce)
        return retrieve_spec(cache, spec, PagedSink(target, decode_blocks, 0)), target

    got, target = load(nonce)
    assert got == LOADED
    # block for block the bytes of the prefill's blocks, whatever a backend keeps in a block's rows
    assert torch.equal(rows(target, decode_blocks, LOADED), rows(source, prefill_blocks, LOADED))
    assert not target.gather(decode_blocks, LOADED, 6 * BS).any()  # the last, partly filled block: not loaded
    got, target = load(b"m" * 16)  # another request's nonce: the full chunks, not the tail
    assert got == 2 * CHUNK
    assert not target.gather(decode_blocks, 2 * CHUNK, 6 * BS).any()


@pytest.mark.parametrize(("n", "loaded"), [(1, 0), (32, 0), (33, 32), (35, 32), (64, 32), (65, 64), (129, 128)])
def test_the_decode_side_loads_whole_blocks_before_the_last_tokens_block(n, loaded):
    assert loadable_tokens(n, BS) == loaded


def test_a_prompt_of_whole_chunks_loads_into_the_blocks_vllm_allocated_only():
    """A 128-token prompt (two chunks): vLLM holds blocks for the 96 tokens promised, not for the last chunk's end."""
    cache = KVCache(paged(False).spec, "m@1", CacheConfig(chunk_size=CHUNK))
    prompt, source = PROMPT[: 2 * CHUNK], paged(True)
    store_transfer(cache, source, TransferSpec("p", pack_tokens(prompt), b"", [3, 7, 1, 9], b"n" * 16))
    end, target, blocks = loadable_tokens(len(prompt), BS), paged(False), [0, 2, 4]
    spec = LoadSpec("d", pack_tokens(prompt), b"", blocks, 0, end, 30.0, b"", tail_nonce=b"n" * 16)
    assert retrieve_spec(cache, spec, PagedSink(target, blocks, 0)) >= end == 96
    assert torch.equal(rows(target, blocks, end), rows(source, [3, 7, 1], end))
