"""Every input that changes a vLLM request's KV is in kvtier's key, or the request is not cached: real vLLM
``Request``, ``MultiModalFeatureSpec`` and ``LoRARequest`` objects against vLLM's own block hasher (no engine).

* kvtier tells two requests' chunks apart exactly where vLLM tells their blocks apart (chunk size = block size).
* The day vLLM's block hashing reads a request field kvtier does not handle, ``test_kvtier_handles_every_field_
  vllm_keys`` fails; at run time such a field, set, makes the request uncached (counted, logged once per kind).
* Extra keys reach the workers' lookups over the socket and the KV events in vLLM's own shape.
"""

from __future__ import annotations

import logging

import pytest
import torch
from blake3 import blake3

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.base.keys import InputKind  # noqa: E402
from kvtier.integrations.vllm.events import TierEvents  # noqa: E402
from kvtier.integrations.vllm.inputs import (  # noqa: E402
    HANDLED,
    Unkeyable,
    request_extras,
    request_salt,
    vllm_keyed_fields,
)
from kvtier.integrations.vllm.lookup import LookupClient, LookupServer, socket_path  # noqa: E402
from kvtier.integrations.vllm.lookups import Lookups  # noqa: E402
from kvtier.integrations.vllm.metadata import unpack_extras  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide  # noqa: E402

CHUNK = 32
N = 4 * CHUNK
TEXT = list(range(100, 100 + N))
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
EMBEDS = torch.randn(N, 24, generator=torch.Generator().manual_seed(0))


def image(identifier: str | None, offset: int = 40, length: int = 40) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def request(req_id: str, tokens: list[int] | None = TEXT, **inputs) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, **inputs)


def embeds_changed_at(row: int) -> torch.Tensor:
    other = EMBEDS.clone()
    other[row, 3] += 1.0
    return other


VARIANTS = {
    "text": {},
    "image a": {"mm_features": [image("a")]},
    "image a again": {"mm_features": [image("a")]},
    "image b": {"mm_features": [image("b")]},
    "image a moved": {"mm_features": [image("a", offset=41)]},
    "two images": {"mm_features": [image("a", 8, 16), image("b", 70, 20)]},
    "lora 1": {"lora_request": LoRARequest("one", 1, "/adapters/one")},
    "lora 1 again": {"lora_request": LoRARequest("one", 1, "/adapters/one")},
    "lora 1 moved": {"lora_request": LoRARequest("one", 1, "/adapters/two")},
    "lora 2": {"lora_request": LoRARequest("two", 2, "/adapters/two")},
    "salt x": {"cache_salt": "x"},
    "salt y": {"cache_salt": "y"},
    "embeds": {"tokens": None, "prompt_embeds": EMBEDS},
    "embeds again": {"tokens": None, "prompt_embeds": EMBEDS.clone()},
    "embeds changed in chunk 2": {"tokens": None, "prompt_embeds": embeds_changed_at(70)},
    "embeds changed in chunk 0": {"tokens": None, "prompt_embeds": embeds_changed_at(0)},
    "embeds bf16": {"tokens": None, "prompt_embeds": EMBEDS.to(torch.bfloat16)},
}


def build(name: str) -> Request:
    inputs = dict(VARIANTS[name])
    return request(name, inputs.pop("tokens", TEXT), **inputs)


def kvtier_keys(side: SchedulerSide, req: Request) -> list[bytes]:
    inputs = side._request_inputs(req)
    assert inputs is not None
    return side._keys(list(req.all_token_ids), inputs)


@pytest.fixture
def side(tmp_path):
    lookups = Lookups(LookupClient([str(tmp_path / "none.sock")]), 0.1)
    yield SchedulerSide(CHUNK, CHUNK, lookups)
    lookups.close()


def test_kvtier_handles_every_field_vllm_keys():
    """Fails the day vLLM's block hashing reads a request field kvtier does not key (and the parse works)."""
    keyed = vllm_keyed_fields()
    assert {"mm_features", "lora_request", "cache_salt", "prompt_embeds", "all_token_ids"} <= keyed
    assert keyed <= HANDLED.keys(), f"vLLM keys {sorted(keyed - HANDLED.keys())}, which kvtier does not"


def test_kvtier_tells_chunks_apart_exactly_where_vllm_tells_blocks_apart(side):
    init_none_hash(sha256)
    hasher = get_request_block_hasher(CHUNK, sha256)
    names = list(VARIANTS)
    vllm = {name: hasher(build(name)) for name in names}
    ours = {name: kvtier_keys(side, build(name)) for name in names}
    assert all(len(vllm[n]) == len(ours[n]) == N // CHUNK for n in names)
    for a in names:
        for b in names:
            for i in range(N // CHUNK):
                assert (vllm[a][i] == vllm[b][i]) == (ours[a][i] == ours[b][i]), (a, b, i)
    # and the cases this rests on: an image changes nothing before its placeholder, every chunk from it on
    text, img = ours["text"], ours["image a"]
    assert img[0] == text[0] and not set(img[1:]) & set(text[1:])
    assert ours["embeds changed in chunk 2"][:2] == ours["embeds"][:2]
    assert ours["embeds changed in chunk 2"][2:] != ours["embeds"][2:]


def test_embedding_digests_match_vllms_per_block_digests():
    extras = request_extras(build("embeds"), CHUNK)
    digests = [s.value for s in extras.spans if s.kind is InputKind.PROMPT_EMBEDS]
    rows = EMBEDS.view(torch.uint8).numpy()
    assert digests == [blake3(rows[i : i + CHUNK].tobytes()).digest() for i in range(0, N, CHUNK)]


def test_lora_and_salt_stay_in_the_tenant_salt():
    assert request_salt(build("text")) == b""
    assert request_salt(build("lora 1")) != request_salt(build("lora 1 moved")) != request_salt(build("salt x"))


@pytest.mark.parametrize("inputs,kind", [
    ({"mm_features": [image(None)]}, "mm_features"),
    ({"mm_features": [image("")]}, "mm_features"),
    ({"mm_features": ["not a feature"]}, "mm_features"),
    ({"tokens": None, "prompt_embeds": EMBEDS, "mm_features": [object()]}, "mm_features"),
])
def test_inputs_kvtier_cannot_key_raise_unkeyable(inputs, kind):
    inputs = dict(inputs)
    with pytest.raises(Unkeyable) as err:
        request_extras(request("r", inputs.pop("tokens", TEXT), **inputs), CHUNK)
    assert err.value.kind == kind


def test_an_unkeyable_request_is_neither_looked_up_loaded_nor_stored(side, caplog):
    side._unhandled = frozenset({"session_id"})  # as if vLLM keyed a field kvtier does not
    bad = [request("img", mm_features=[image(None)]), request("img2", mm_features=[image(None)]),
           request("sess", session_id="s-1")]
    good = build("image a")
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm.scheduler"):
        for req in [*bad, good]:
            side.new_request(req)
            assert side.matched_tokens(req, 0) == (0, False)
            req.num_computed_tokens = N
            side.finished(req, list(range(N // CHUNK)))
    assert side.lookups.asked == 1  # the good request only
    (save,) = side._saves
    assert save.req_id == good.request_id and unpack_extras(save.extras) == request_extras(good, CHUNK)
    name = "kvtier_engine_uncached_requests_total"
    assert sorted(side.take_counters(), key=str) == [[name, {"kind": "mm_features"}, 2],
                                                     [name, {"kind": "session_id"}, 1]]
    assert side.take_counters() == []
    assert len([r for r in caplog.records if "cannot key" in r.getMessage()]) == 2  # once per kind


def test_extra_keys_reach_the_workers_lookup_and_the_events(tmp_path):
    cache = KVCache(SPEC, "m@1", CacheConfig(chunk_size=CHUNK))
    events = TierEvents(cache)
    lora = LoRARequest("one", 1, "/adapters/one")
    req = request("r", mm_features=[image("a")], lora_request=lora, cache_salt="x")
    salt, extras = request_salt(req), request_extras(req, CHUNK)
    other_image = request_extras(request("s", mm_features=[image("b")], lora_request=lora, cache_salt="x"), CHUNK)
    cache.store(TEXT, torch.zeros(SPEC.chunk_shape(N), dtype=SPEC.dtype), salt=salt, extras=extras)
    path = socket_path(str(tmp_path), "engine", 0)
    server, client = LookupServer(cache, path), LookupClient([path])
    try:
        assert client.lookup(TEXT, salt, extras) == N
        assert client.lookup(TEXT, salt, other_image) == CHUNK  # the chunk before the image only
        assert client.lookup(TEXT, salt) == 0  # the adapter's name keys every chunk, the salt the first
    finally:
        client.close()
        server.close()
    (stored,) = events.take().get_all_events()
    assert isinstance(stored, BlockStored) and stored.lora_name == "one"
    assert stored.extra_keys == [("one", "x"), ("one", ("a", 8)), ("one", ("a", -24)), ("one",)]
    events.close()
    cache.close()


def test_embedding_digests_are_published_per_block():
    cache = KVCache(SPEC, "m@1", CacheConfig(chunk_size=CHUNK))
    events = TierEvents(cache)
    extras = request_extras(build("embeds"), CHUNK)
    cache.store([0] * N, torch.zeros(SPEC.chunk_shape(N), dtype=SPEC.dtype), extras=extras)
    (stored,) = events.take().get_all_events()
    rows = EMBEDS.view(torch.uint8).numpy()
    assert stored.extra_keys == [(blake3(rows[i : i + CHUNK].tobytes()).digest(),) for i in range(0, N, CHUNK)]
    assert stored.lora_name is None
    events.close()
    cache.close()
