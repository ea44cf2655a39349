"""``kvtier calibrate``: measure this machine's tiers and codecs, and say which codec to give each tier.

    kvtier calibrate                          # the tiers of $KVTIER_CONFIG / KVTIER_* (default: memory)
    kvtier calibrate --config kvtier.yaml --cold --json results/calibration.json
    kvtier calibrate --spec 30x3x64 --mib 64  # another KV shape (layers x kv_heads x head_dim), less data

Prints each codec's ratio and encode / decode GB/s (one thread and every core) against a plain copy, then
the load and store GB/s of KV of every (tier, codec) pair through a one-tier KVCache, and per tier the
codec that loads fastest and what each denser codec costs there. ``--cold`` drops the page cache before
every read (root only), as after a restart; without it a disk tier may be read from the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvtier.base.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="which codec loads fastest from which tier on this machine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=None, help="kvtier YAML config (default: env / built-in)")
    p.add_argument("--spec", default="32x8x128", help="KV shape, layers x kv_heads x head_dim (default: Llama-3-8B)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: the config's)")
    p.add_argument("--mib", type=int, default=256, help="MiB of KV per measurement (default 256)")
    p.add_argument("--codecs", nargs="+", default=None, help="codecs to compare (default: every family)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions; the best is kept (default 3)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before every read (needs root)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.set_defaults(func=run)


def parse_spec(text: str, dtype: str):
    from kvtier.base.layout import KVSpec

    try:
        layers, heads, dim = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--spec wants layers x kv_heads x head_dim, e.g. 32x8x128; got {text!r}") from None
    return KVSpec(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype)


def drop_page_cache() -> None:
    """Write dirty pages back and drop the page cache, so the next read comes from the device."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
    except OSError as exc:
        raise ConfigError(f"--cold needs root to drop the page cache: {exc}") from None


def named_tiers(config) -> list[tuple[str, object]]:
    """``(name, tier config)`` per configured tier, named by kind (``disk``, ``disk2`` ... when repeated)."""
    names: list[str] = []
    for cfg in config.tiers:
        name, n = cfg.kind, 2
        while name in names:
            name, n = f"{cfg.kind}{n}", n + 1
        names.append(name)
    return list(zip(names, config.tiers))


def run(args: argparse.Namespace) -> int:
    from kvtier.apps.calibrate.measure import CODECS, calibrate
    from kvtier.core.config import CacheConfig

    try:
        config = CacheConfig.load(args.config)
        spec = parse_spec(args.spec, args.dtype)
        if args.cold:
            drop_page_cache()  # fail now, not after minutes of measuring
        result = calibrate(named_tiers(config), spec=spec, chunk_tokens=args.chunk_size or config.chunk_size,
                           sample_bytes=args.mib << 20, codecs=args.codecs or CODECS, reps=max(1, args.reps),
                           drop_caches=drop_page_cache if args.cold else None,
                           progress=lambda msg: print(f"measuring {msg} ...", file=sys.stderr, flush=True))
    except ConfigError as exc:
        print(f"kvtier calibrate: {exc}", file=sys.stderr)
        return 2
    print(f"KV {args.spec} {args.dtype}, {args.mib} MiB per measurement; plain copy {result.memcpy_gbs:.2f} GB/s")
    print(result.table())
    print()
    for line in result.advice():
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=1))
    return 0
