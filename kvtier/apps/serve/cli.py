"""``kvtier serve``: the OpenAI-compatible server over a transformers model, with or without kvtier.

    kvtier serve                                   # SmolLM2-135M-Instruct, memory tier, 127.0.0.1:8000
    kvtier serve --model ./my-llama --config kvtier.yaml --port 9000
    kvtier serve --no-cache --port 8001            # the same server without kvtier, for comparisons
    kvtier serve --blend                           # also reuse cached passages wherever they sit (RAG)
    kvtier serve --admin-key-file /etc/kvtier/admin.key   # the admin API (/admin/v1/...; kvtier cache)

The cache is configured like the library (``--config`` YAML, else ``KVTIER_CONFIG``, else ``KVTIER_*``
variables); ``--chunk-size`` and ``--memory-bytes`` override single fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from kvtier.api.admin import admin_key_from
from kvtier.base.errors import ConfigError
from kvtier.core.config import CacheConfig, parse_size
from kvtier.integrations.blend.config import BlendConfig
from kvtier.web.http_limits import add_http_limit_flags, http_limits
from kvtier.web.startup import freeze_startup_objects


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server with tiered prefix caching",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local transformers model folder (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="model id reported by /v1/models and expected in requests")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--config", help="kvtier YAML config (tiers, capacities, chunk size)")
    p.add_argument("--chunk-size", type=int, help="tokens per cached chunk (overrides the config)")
    p.add_argument("--memory-bytes", help="capacity of the memory tier, e.g. 2GiB (overrides the config)")
    p.add_argument("--no-cache", action="store_true", help="serve without kvtier (the baseline)")
    p.add_argument("--blend", action="store_true",
                   help="reuse cached segments (chat messages; text between --blend-separator) in any position")
    p.add_argument("--blend-ratio", type=float, default=BlendConfig.recompute_ratio,
                   help="share of reused tokens recomputed when blending (default %(default)s)")
    p.add_argument("--blend-max-deviation", type=float, default=BlendConfig.max_deviation,
                   help="quality gate: a larger measured KV deviation means a full prefill (default %(default)s)")
    p.add_argument("--blend-separator", help="string separating reusable passages in text prompts")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait; more get 429 at once")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens when a request names none")
    p.add_argument("--max-body", default="8MiB", help="largest request body; larger ones get 413 (default 8MiB)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 on a busy machine)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--admin-key-file", help="file whose first line is the admin API's key (default: "
                   "$KVTIER_ADMIN_KEY; neither: no admin, tenant keys still look up and clear their own entries)")
    e = p.add_argument_group("cache events (for kvtier route; see /kvtier/info)")
    e.add_argument("--events-port", type=int, default=0, help="ZMQ PUB port of the event stream (default: any free)")
    e.add_argument("--events-control-port", type=int, default=0, help="ZMQ port answering snapshot requests")
    e.add_argument("--no-events", action="store_true", help="publish no cache events")
    e.add_argument("--events-allow", action="append", default=None, metavar="KEY",
                   help="a router's events key (printed by kvtier route) that may subscribe; repeat for several, "
                        "'any' for any client (default: $KVTIER_EVENTS_ALLOW, comma-separated, plus the key of "
                        "this user's kvtier route on this host)")
    add_http_limit_flags(p)
    p.set_defaults(func=run)
    return p


def cache_config(args: argparse.Namespace) -> CacheConfig | None:
    """The CacheConfig the flags describe, or None for ``--no-cache``."""
    if args.no_cache:
        return None
    overrides = {}
    if args.chunk_size is not None:
        overrides["chunk_size"] = args.chunk_size
    config = CacheConfig.load(args.config, **overrides)
    if args.memory_bytes is not None:
        size = parse_size(args.memory_bytes)
        tiers = [dataclasses.replace(t, capacity_bytes=size) if t.kind == "memory" else t for t in config.tiers]
        config = dataclasses.replace(config, tiers=tuple(tiers))
    return config


def events_allow(args: argparse.Namespace):
    """The Allow the flags (else ``KVTIER_EVENTS_ALLOW``) describe: the keys named, plus this user's local
    router key; ``any`` lets any client in (the behaviour before allow-lists, open to E-1's subscription flood)."""
    import os

    from kvtier.events.keys import Allow

    given = args.events_allow if args.events_allow is not None else \
        [k for k in os.environ.get("KVTIER_EVENTS_ALLOW", "").split(",") if k.strip()]
    keys = tuple(k.strip() for k in given if k.strip().lower() != "any")
    return Allow(keys=keys, any=len(keys) < len(given))


def blend_config(args: argparse.Namespace) -> BlendConfig | None:
    """The BlendConfig the flags describe, or None without ``--blend``."""
    if not args.blend:
        return None
    return BlendConfig(recompute_ratio=args.blend_ratio, max_deviation=args.blend_max_deviation)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.apps.serve.app import create_app, server_config
    from kvtier.apps.serve.backend import Backend, ServerConfig, check_model_path
    from kvtier.apps.serve.events import attach_events
    from kvtier.events.publisher import PublisherConfig

    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ServerConfig(model_path=check_model_path(args.model), served_name=args.served_model_name,
                              cache=cache_config(args), max_queue=args.max_queue,
                              default_max_tokens=args.max_tokens, dtype=args.dtype, blend=blend_config(args),
                              blend_separator=args.blend_separator, max_body_bytes=parse_size(args.max_body),
                              http=http_limits(args), admin_key=admin_key_from(args.admin_key_file))
        backend = Backend.from_config(config)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    tiers = ", ".join(t.kind for t in config.cache.tiers) if config.cache else "off"
    print(f"kvtier serve: {backend.name} on http://{args.host}:{args.port} (kvtier cache: {tiers})", flush=True)
    app = create_app(backend)
    try:
        events = None if args.no_events else PublisherConfig(args.host, args.events_port, args.events_control_port,
                                                              allow=events_allow(args))
        publisher = attach_events(app, backend, events)
    except ConfigError as exc:
        backend.close()
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(server_config(app, backend, args.host, args.port, args.log_level))
    freeze_startup_objects()  # the model and its modules out of the cyclic GC: no 0.4 s collections under load
    try:
        server.run()
    finally:
        if publisher is not None:
            publisher.close()
        backend.close()
    return 0 if server.started else 1  # e.g. the port was taken
