"""SGLang's own page keys, driven from its installed source: the helpers tests/integrations/test_sglang_keys.py and
benchmarks/_hostile_round3.py share (a RadixKey compiled from SGLang's source, since importing its module needs
torchvision; disk-tier configs; page-aligned token ids; the writer script of another server's process)."""

from __future__ import annotations

import __future__
import ast
from array import array
from pathlib import Path
from typing import Optional

import sglang
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE = 4


SRT = Path(sglang.__file__).parent / "srt"


def sglang_class(relative: str, name: str) -> type:
    """Class ``name`` of SGLang's module at ``srt/relative``, compiled from its source alone (module docstring)."""
    path = SRT / relative
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)
    namespace = {"__name__": f"sglang_source.{name}", "array": array, "Optional": Optional}
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)  # noqa: S102 - SGLang's own installed source
    return namespace[name]


RadixKey = sglang_class("mem_cache/radix_cache.py", "RadixKey")


def radix_key(tokens, extra_key: str | None = None, cache_salt: str | None = None):
    return RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)


def disk(path: Path, **extra) -> dict:
    return {"tiers": [{"kind": "disk", "path": str(path), "capacity_bytes": "32MiB", "fsync": False,
                       "o_direct": False}], **extra}


def text(n_pages: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n_pages * PAGE)]


def flush(store) -> None:
    """Wait for the disk tier's writes (stores are written behind)."""
    for tier in store.cache.tiers:
        getattr(tier, "flush", lambda: None)()


def keys_of(key) -> list[str]:
    return get_storage_hash_str(key, None, page_size=PAGE)


WRITER = """
import sys
from harness.sglang_pool import HostPool, backend
from harness.sglang_keys import disk, flush, keys_of, radix_key, text
pool = HostPool("layer_first")
pool.fill(5)
store = backend(pool, disk(sys.argv[1], tenant="b"))
assert all(store.batch_set_v1(keys_of(radix_key(text(3))), pool.host_indices(0, 3)))
flush(store)
store.close()
"""
