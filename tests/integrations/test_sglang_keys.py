"""What SGLang 0.5.23's page keys carry into kvtier's HiCache backend, and clears that stay in their namespace.

Page keys come from SGLang's own ``get_storage_hash_str`` (the function its cache controller calls on a request's
radix key) over SGLang's own ``RadixKey``. ``radix_cache`` does not import on this machine (it pulls in
torchvision, see ``sglang_pool``), so ``RadixKey`` is compiled from its source in that module. Images, audio and
video reach the key as their placeholder tokens, which SGLang replaces by 62-bit values derived from each item's
content hash (``MultimodalDataItem.pad_values``, from ``MM_PAD_SHIFT_VALUE`` = 1,000,000 up). What SGLang does
in code that does not import here (the LoRA id appended to ``extra_key``, prompt embeddings refused while the
radix cache is on) is checked in its source, so these tests fail the day SGLang keys less.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="scripts/setup.sh test installs sglang")

from harness.sglang_keys import (  # noqa: E402
    PAGE,
    SRT,
    WRITER,
    disk,
    flush,
    keys_of,
    radix_key,
    text,
)
from harness.sglang_pool import HostPool, backend  # noqa: E402

MM_PAD_SHIFT = 1_000_000  #: SGLang's MM_PAD_SHIFT_VALUE: placeholder values start here


def image(first: int) -> list[int]:
    """Two pages of an image's placeholders: 62-bit values whose low 32 bits are the same for every image, so
    only a key that hashes token ids whole tells two images apart."""
    return [MM_PAD_SHIFT + ((first + i % 4) << 32) for i in range(2 * PAGE)]


@pytest.fixture
def stored(tmp_path):
    """A backend on a disk tier that stored the pages of a text-and-image prompt (with extra key and salt)."""
    pool = HostPool("layer_first")
    pool.fill(3)
    store = backend(pool, disk(tmp_path))
    base = radix_key(text(1) + image(1) + text(1, seed=1), extra_key="lora-1", cache_salt="s")
    assert all(store.batch_set_v1(keys_of(base), pool.host_indices(0, 4)))
    flush(store)
    yield store, base
    store.close()


@pytest.mark.parametrize("change", ["image", "lora", "extra_key", "cache_salt"])
def test_every_input_sglang_keys_makes_another_page(stored, change):
    """Another image, adapter, extra key or salt: none of the request's pages is a hit (from the first one
    it changes: the image's pages; every page for the rest, which seed the chain)."""
    store, base = stored
    other = {"image": radix_key(text(1) + image(2) + text(1, seed=1), "lora-1", "s"),
             "lora": radix_key(base.token_ids, "lora-2", "s"), "extra_key": radix_key(base.token_ids, None, "s"),
             "cache_salt": radix_key(base.token_ids, "lora-1", "t")}[change]
    assert store.batch_exists(keys_of(base)) == 4
    assert store.batch_exists(keys_of(other)) == (1 if change == "image" else 0)


def test_the_same_image_twice_is_a_hit(stored):
    store, base = stored
    again = radix_key(list(base.token_ids), "lora-1", "s")  # a new key object: equal content, equal pages
    pool = store.mem_pool_host
    assert store.batch_get_v1(keys_of(again), pool.host_indices(8, 4)) == [True] * 4  # into other host pages
    assert torch.equal(pool.kv_buffer[:, :, 32:48], pool.kv_buffer[:, :, :16])


@pytest.mark.parametrize("other", [{"tenant": "b"}, {"model": "org/model-b"}, {"tp_rank": 1}],
                         ids=["tenant", "model", "tp-rank"])
def test_clear_leaves_other_namespaces_pages_in_the_same_disk_path(tmp_path, other):
    """Tenant (or model, or rank) b's pages left in the disk path survive tenant a's clear; a's are gone."""
    keys = keys_of(radix_key(text(3)))
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


def test_sglang_keys_lora_and_refuses_prompt_embeddings_with_its_radix_cache_on():
    """The two facts kvtier relies on that live in SGLang code that does not import here (module docstring)."""
    init = next(n for n in ast.walk(ast.parse((SRT / "managers/schedule_batch.py").read_text()))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__" and "lora_id" in ast.unparse(n.args))
    appends = [ast.unparse(n) for n in ast.walk(init) if isinstance(n, ast.Assign)
               and ast.unparse(n.targets[0]) == "extra_key"]
    assert any("lora_id" in a for a in appends), appends  # Req: extra_key = (extra_key or '') + lora_id
    tokenize = (SRT / "managers/tokenizer_manager.py").read_text()
    refusal = tokenize[tokenize.index("if obj.input_embeds is not None:"):][:400]
    assert "disable_radix_cache" in refusal and "raise ValueError" in refusal




def test_another_servers_pages_survive_this_servers_clear(tmp_path):
    """S-1 across processes: server b (its own process, ended) left pages in the disk path; server a's clear
    removes a's pages only, and b's still load, equal to what b stored."""
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], check=True, env=env, timeout=300)
    keys = keys_of(radix_key(text(3)))
    a = backend(HostPool("layer_first"), disk(tmp_path, tenant="a"))
    a.mem_pool_host.fill(6)
    assert all(a.batch_set_v1(keys, a.mem_pool_host.host_indices(0, 3)))
    flush(a)
    assert a.clear() is True and a.batch_exists(keys) == 0
    a.close()
    b = backend(HostPool("layer_first"), disk(tmp_path, tenant="b"))
    assert b.batch_get_v1(keys, b.mem_pool_host.host_indices(0, 3)) == [True] * 3
    written = HostPool("layer_first")
    written.fill(5)
    assert torch.equal(b.mem_pool_host.kv_buffer[:, :, :12], written.kv_buffer[:, :, :12])
    b.close()
