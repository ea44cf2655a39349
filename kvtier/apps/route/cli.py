"""``kvtier route``: a cache-aware, load-bounded, session-sticky router in front of OpenAI-compatible replicas.

    kvtier route --replica http://10.0.0.1:8000 --replica http://10.0.0.2:8000 --port 8000
    kvtier route --replica URL ... --policy round-robin --no-sticky        # the baseline
    kvtier route --replica URL ... --model ./my-llama --tier-weight disk=0.7
    kvtier route --replica http://h1:8000,events=tcp://h1:5557,replay=tcp://h1:5558,block-size=32 ...
    kvtier route --prefill http://h1:8000 --decode http://h2:8000     # prefill/decode disaggregation

Replicas are kvtier serve (whose /kvtier/info and event stream tell the router precisely where prefixes
are), vLLM (whose KV events, with ``events=``, tell it what sits in vLLM's cache and in the kvtier tiers behind
it: docs/integrations/vllm-fleet.md), or any OpenAI-compatible server (the router then relies on its own
record of what it sent where). ``--model`` is the folder whose tokenizer and chat template the replicas use:
the router hashes prompts exactly as they do. Without it, the model the replicas name at /v1/models is used
if its tokenizer is at hand (a local folder or the local Hugging Face cache); otherwise the router says to
pass --model and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from kvtier.base.errors import ConfigError
from kvtier.integrations.prompt_cache import DEFAULT_MAX_ENTRIES
from kvtier.web.http_limits import add_http_limit_flags, http_limits


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("route", help="cache-aware router in front of several replicas",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replica", action="append", default=[], metavar="URL[,OPTIONS]",
                   help="base URL of a replica (repeat); a vLLM replica adds its KV events: "
                        "URL,events=tcp://H:P,replay=tcp://H:P,block-size=N[,topic=T][,media=GPU:CPU:...]")
    p.add_argument("--prefill", action="append", default=[], metavar="URL[,OPTIONS]",
                   help="prefill/decode disaggregation: a prefill replica (repeat; vLLM with the kvtier connector), "
                        "chosen by cached prefix and load; needs --decode, excludes --replica")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode replica (repeat), chosen by load")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1,
                   help="router processes on the port (SO_REUSEPORT), each following the replicas itself")
    p.add_argument("--model", help="folder of the replicas' tokenizer and chat template (default: the model "
                                   "the replicas name at /v1/models, if its tokenizer is at hand)")
    r = p.add_argument_group("routing")
    r.add_argument("--policy", default="load-bounded", choices=["load-bounded", "prefix", "round-robin", "random"])
    r.add_argument("--sticky", action=argparse.BooleanOptionalAction, default=True,
                   help="send a session (X-Session-ID or the user field) back to its replica (default on)")
    r.add_argument("--sessions", choices=["remembered", "rendezvous"],
                   help="a sticky session goes back to the replica this router sent it to (remembered), or to its "
                        "rendezvous home within the load bound, the same in every router (default: rendezvous "
                        "with --workers above 1, else remembered)")
    r.add_argument("--epsilon", type=float, default=0.25, help="load bound: no replica above (1+eps) x mean")
    r.add_argument("--load-floor", type=int, default=2,
                   help="the load bound never holds a replica below this many requests in flight")
    r.add_argument("--session-epsilon", type=float, default=0.25,
                   help="session bound: a new session only on a replica homing at most max((1+eps) x mean, ceil(mean)) "
                        "sessions")
    r.add_argument("--tie-break", default="home", choices=["home", "random"],
                   help="between replicas that cost the same: the prompt's rendezvous home (stable), or random as "
                        "llm-d's max-score picker")
    r.add_argument("--tier-weight", action="append", default=[], metavar="TIER=W",
                   help="worth of a cached token in TIER (memory 1.0, disk 0.9, redis 0.8 by default; vLLM media: "
                        "GPU 1.0, CPU 0.8, DISK and STORAGE 0.7, SHARED 0.6)")
    r.add_argument("--decode-stream-tokens", type=float, help="cost of one decoding request, in prefill tokens")
    r.add_argument("--record-ttl", type=float, default=600.0,
                   help="seconds the router trusts its own record of replicas that publish no events")
    r.add_argument("--record-chunk-tokens", type=int, default=256,
                   help="tokens per key in that record: a shared prefix shorter than this is not seen (default "
                        "%(default)s; smaller: finer matching for more hashing)")
    f = p.add_argument_group("limits and failures")
    f.add_argument("--max-sessions", type=int, default=100_000,
                   help="sticky sessions remembered (remembered placement; least recently used forgotten first)")
    f.add_argument("--prompt-cache-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                   help="message prefixes whose token ids are kept for incremental tokenization (LRU)")
    f.add_argument("--max-in-flight", type=int, default=256, help="requests proxied at once")
    f.add_argument("--max-queue", type=int, default=1024, help="requests waiting beyond that; more get 429")
    f.add_argument("--max-attempts", type=int, default=3, help="replicas tried for a request that failed early")
    f.add_argument("--read-timeout", type=float, default=600.0, help="longest wait for a replica's next bytes")
    f.add_argument("--admin-timeout", type=float, default=60.0,
                   help="seconds an admin call waits for all replicas' answers (default %(default)s)")
    f.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    f.add_argument("--events-key", metavar="FILE",
                   help="the router's CURVE key pair for replicas' event sockets, created if missing; replicas "
                        "allow its public key with --events-allow (default: this user's per-host key, which "
                        "local replicas of the same user allow by themselves)")
    add_http_limit_flags(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)
    return p


def router_config(args: argparse.Namespace):
    """The RouterConfig the flags describe."""
    from kvtier.apps.route.config import (
        AdmissionConfig,
        HealthConfig,
        IndexConfig,
        ProxyConfig,
        RouterConfig,
        SessionPlacement,
        default_routing,
        parse_replica,
    )
    from kvtier.fleet.scoring import Routing, TieBreak

    weights = dict(default_routing().tier_weights)
    for item in args.tier_weight:
        tier, sep, value = item.partition("=")
        try:
            weights[tier.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not tier.strip():
            raise ConfigError(f"--tier-weight takes TIER=WEIGHT, got {item!r}")
    routing = dataclasses.replace(default_routing(), routing=Routing(args.policy), sticky=args.sticky,
                                  epsilon=args.epsilon, session_epsilon=args.session_epsilon,
                                  load_floor=args.load_floor, tier_weights=tuple(weights.items()),
                                  tie_break=TieBreak(args.tie_break), max_sessions=args.max_sessions)
    if args.decode_stream_tokens is not None:
        routing = dataclasses.replace(routing, decode_stream_tokens=args.decode_stream_tokens)
    if routing.epsilon < 0 or routing.session_epsilon < 0:
        raise ConfigError("--epsilon and --session-epsilon must not be negative")
    if routing.load_floor < 1:
        raise ConfigError(f"--load-floor must be at least 1, got {routing.load_floor}")
    if args.max_sessions < 1 or args.prompt_cache_entries < 1:
        raise ConfigError("--max-sessions and --prompt-cache-entries must be at least 1")
    if bool(args.prefill) != bool(args.decode) or bool(args.prefill) == bool(args.replica):
        raise ConfigError("give --replica URL ..., or --prefill URL ... with --decode URL ... (not both)")
    for item in args.decode:
        parse_replica(item)  # a malformed decode URL is named now, not in the serving process
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    if args.record_chunk_tokens < 1:
        raise ConfigError(f"--record-chunk-tokens must be at least 1, got {args.record_chunk_tokens}")
    sessions = SessionPlacement(args.sessions or ("rendezvous" if args.workers > 1 else "remembered"))
    return RouterConfig(
        replicas=tuple(parse_replica(item) for item in args.replica or args.prefill), routing=routing,
        proxy=ProxyConfig(read_timeout_s=args.read_timeout, max_attempts=args.max_attempts,
                          admin_timeout_s=args.admin_timeout),
        admission=AdmissionConfig(max_in_flight=args.max_in_flight, max_queue=args.max_queue),
        health=HealthConfig(interval_s=args.health_interval),
        index=IndexConfig(recent_ttl_s=args.record_ttl, chunk_size=args.record_chunk_tokens),
        tokenizer=Path(args.model) if args.model else None, http=http_limits(args),
        events_key=Path(args.events_key) if args.events_key else None, sessions=sessions)


def run(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: F401  (kvtier[server]: a missing extra is named before anything else is tried)

    from kvtier.apps.route.model import tokenizer_for
    from kvtier.apps.route.workers import serve, supervise

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request and health probe
    try:
        config = router_config(args)
        tokenizer = tokenizer_for(args.model, [r.url for r in config.replicas], args.prompt_cache_entries)
    except ConfigError as exc:
        print(f"kvtier route: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, whatever a library said
        return 2
    policy = config.routing.routing.value + (f" + {config.sessions.value} sessions" if config.routing.sticky else "")
    pools = (f"{len(config.replicas)} replicas" if not args.decode else
             f"{len(config.replicas)} prefill + {len(args.decode)} decode replicas")
    print(f"kvtier route: {pools}, {policy}, {args.workers} worker(s) on "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        from kvtier.events.keys import default_key_file, load_or_create

        key_file = config.events_key or default_key_file()
        public = load_or_create(key_file)[0].decode()
    except (ConfigError, OSError) as exc:
        print(f"kvtier route: events key {exc}", file=sys.stderr)
        return 2
    print(f"kvtier route: events key {public} (from {key_file}; replicas on other hosts or of other users need "
          f"kvtier serve --events-allow '{public}')", flush=True)
    if args.workers == 1:
        serve(args, config, tokenizer)
        return 0
    args.model = str(tokenizer.source)  # the workers load what the parent found, without asking the replicas
    del tokenizer
    return supervise(args, router_config)
