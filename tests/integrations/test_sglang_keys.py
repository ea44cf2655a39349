"""What SGLang 0.5.23's page keys carry into kvtier's HiCache backend, and clears that stay in their namespace.

Page keys come from SGLang's own ``get_storage_hash_str`` (the function its cache controller calls on a request's
radix key). ``RadixKey`` itself does not import on this machine (``radix_cache`` pulls in torchvision, see
``sglang_pool``), so ``Key`` carries the three attributes SGLang's function reads from it: ``token_ids``,
``extra_key`` (SGLang appends the LoRA adapter's id to it) and ``cache_salt``. Images, audio and video reach the
key as their placeholder tokens, which SGLang replaces by 62-bit values derived from each item's content hash
(``MultimodalDataItem.pad_values``, from ``MM_PAD_SHIFT_VALUE`` = 1,000,000 up).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="scripts/setup.sh test installs sglang")

from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from tests.integrations.sglang_pool import HostPool, backend  # noqa: E402

PAGE = 4
MM_PAD_SHIFT = 1_000_000  #: SGLang's MM_PAD_SHIFT_VALUE: placeholder values start here


@dataclass
class Key:
    """The attributes of SGLang's ``RadixKey`` that ``get_storage_hash_str`` reads (module docstring)."""

    token_ids: list[int]
    extra_key: str | None = None
    cache_salt: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


def disk(path: Path, **extra) -> dict:
    return {"tiers": [{"kind": "disk", "path": str(path), "capacity_bytes": "32MiB", "fsync": False,
                       "o_direct": False}], **extra}


def text(n_pages: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n_pages * PAGE)]


def image(first: int) -> list[int]:
    """Two pages of an image's placeholders: 62-bit values whose low 32 bits are the same for every image, so
    only a key that hashes token ids whole tells two images apart."""
    return [MM_PAD_SHIFT + ((first + i % 4) << 32) for i in range(2 * PAGE)]


def flush(store) -> None:
    """Wait for the disk tier's writes (stores are written behind)."""
    for tier in store.cache.tiers:
        getattr(tier, "flush", lambda: None)()


def keys_of(key: Key) -> list[str]:
    return get_storage_hash_str(key, None, page_size=PAGE)


@pytest.fixture
def stored(tmp_path):
    """A backend on a disk tier that stored the pages of a text-and-image prompt (with extra key and salt)."""
    pool = HostPool("layer_first")
    pool.fill(3)
    store = backend(pool, disk(tmp_path))
    base = Key(text(1) + image(1) + text(1, seed=1), extra_key="lora-1", cache_salt="s")
    assert all(store.batch_set_v1(keys_of(base), pool.host_indices(0, 4)))
    flush(store)
    yield store, base
    store.close()


@pytest.mark.parametrize("change", ["image", "lora", "extra_key", "cache_salt"])
def test_every_input_sglang_keys_makes_another_page(stored, change):
    """Another image, adapter, extra key or salt: none of the request's pages is a hit (from the first one
    it changes: the image's pages; every page for the rest, which seed the chain)."""
    store, base = stored
    other = {"image": Key(text(1) + image(2) + text(1, seed=1), "lora-1", "s"),
             "lora": Key(base.token_ids, "lora-2", "s"), "extra_key": Key(base.token_ids, None, "s"),
             "cache_salt": Key(base.token_ids, "lora-1", "t")}[change]
    assert store.batch_exists(keys_of(base)) == 4
    assert store.batch_exists(keys_of(other)) == (1 if change == "image" else 0)


def test_the_same_image_twice_is_a_hit(stored):
    store, base = stored
    again = Key(list(base.token_ids), "lora-1", "s")
    pool = store.mem_pool_host
    assert store.batch_get_v1(keys_of(again), pool.host_indices(8, 4)) == [True] * 4  # into other host pages
    assert torch.equal(pool.kv_buffer[:, :, 32:48], pool.kv_buffer[:, :, :16])


@pytest.mark.parametrize("other", [{"tenant": "b"}, {"model": "org/model-b"}, {"tp_rank": 1}],
                         ids=["tenant", "model", "tp-rank"])
def test_clear_leaves_other_namespaces_pages_in_the_same_disk_path(tmp_path, other):
    """Tenant (or model, or rank) b's pages left in the disk path survive tenant a's clear; a's are gone."""
    keys = keys_of(Key(text(3)))
    pool = HostPool("layer_first")
    pool.fill(5)
    tenant = {"tenant": other["tenant"]} if "tenant" in other else {}
    b_config = {k: v for k, v in other.items() if k != "tenant"}
    b = backend(pool, disk(tmp_path, **tenant), tp_size=2, **b_config)
    assert all(b.batch_set_v1(keys, pool.host_indices(0, 3)))
    flush(b)
    b.close()
    a = backend(HostPool("layer_first"), disk(tmp_path, tenant="a"), tp_size=2)
    a_pool = a.mem_pool_host
    a_pool.fill(6)
    assert all(a.batch_set_v1(keys, a_pool.host_indices(0, 3)))
    flush(a)
    assert a.batch_exists(keys) == 3
    assert a.clear() is True
    assert a.batch_exists(keys) == 0
    a.close()
    b = backend(HostPool("layer_first"), disk(tmp_path, **tenant), tp_size=2, **b_config)
    dst = b.mem_pool_host
    assert b.batch_get_v1(keys, dst.host_indices(0, 3)) == [True] * 3
    assert torch.equal(dst.kv_buffer[:, :, :12], pool.kv_buffer[:, :, :12])
    assert b.clear() is True and b.batch_exists(keys) == 0  # and b's own clear does remove them
    b.close()
