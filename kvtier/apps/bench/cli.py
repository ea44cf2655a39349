"""``kvtier bench``: realistic workloads against OpenAI-compatible endpoints, TTFT measured on the client.

    kvtier bench multiround --url http://127.0.0.1:8000             # any endpoint: kvtier serve, vLLM ...
    kvtier bench multiround --url kvtier=http://h:8000 --url vllm=http://h:8001
    kvtier bench qa --serve                  # start kvtier serve with and without the cache, compare, stop
    kvtier bench trace --timestamps --speed 4 --url http://127.0.0.1:8000

Writes ``<out>/<workload>.json`` (every request, raw) and ``<out>/<workload>.png`` (TTFT per round, one line
per target) and prints the TTFT table. With two targets the table shows speed-ups (second / first).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from contextlib import ExitStack
from dataclasses import asdict
from functools import partial
from pathlib import Path

from kvtier.apps.bench.client import Target
from kvtier.base.errors import ConfigError
from kvtier.fleet import workloads as wl


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark OpenAI-compatible endpoints on prefix-heavy workloads",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=["multiround", "qa", "trace"])
    g = p.add_argument_group("targets")
    g.add_argument("--url", action="append", default=[], help="[label=]URL of an endpoint (repeatable)")
    g.add_argument("--serve", action="store_true", help="start kvtier serve with and without kvtier and compare")
    g.add_argument("--serve-args", default="", help="extra arguments for the started servers, e.g. '--model DIR'")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (kvtier serve: the cache tenant)")
    g.add_argument("--wait", type=float, default=0, help="seconds to wait for --url endpoints to come up")
    o = p.add_argument_group("run")
    o.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (trace: open loop)")
    o.add_argument("--interleave", action="store_true",
                   help="run the targets side by side, taking turns, instead of one after the other")
    o.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request")
    o.add_argument("--out", default="results/bench", help="folder for the JSON and PNG")
    o.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("multiround")
    m.add_argument("--users", type=int, default=2)
    m.add_argument("--rounds", type=int, default=4)
    m.add_argument("--sessions", action="store_true", help="name each conversation in the user field")
    m.add_argument("--system-words", type=int, default=300)
    m.add_argument("--turn-words", type=int, default=150)
    q = p.add_argument_group("qa (LooGLE long-dependency QA)")
    q.add_argument("--data", help="workload file (default: $KVTIER_WORKLOADS or ../shared/workloads)")
    q.add_argument("--docs", type=int, default=3)
    q.add_argument("--questions", type=int, default=3)
    q.add_argument("--doc-chars", type=int, default=12_000, help="cut documents to fit the model's context")
    q.add_argument("--order", choices=["interleaved", "random"], default="interleaved")
    t = p.add_argument_group("trace (Mooncake format)")
    t.add_argument("--requests", type=int, default=20)
    t.add_argument("--block-tokens", type=int, default=64, help="tokens per 512-token trace block (scale-down)")
    t.add_argument("--max-prompt-tokens", type=int, default=4096)
    t.add_argument("--timestamps", action="store_true", help="send at the trace's arrival times (else back to back)")
    t.add_argument("--speed", type=float, default=1.0, help="time compression of --timestamps")
    t.add_argument("--conversations", type=int, default=0,
                   help="replay this many of the trace's conversations (rows sharing a first block, drawn with "
                        "--seed) side by side, each in turn order (0: the first --requests rows)")
    t.add_argument("--min-turns", type=int, default=4, help="--conversations draws from those with this many rows")
    t.add_argument("--max-turns", type=int, default=0, help="--conversations keeps each one's first this many rows "
                                                            "(0: all)")
    p.set_defaults(func=run)
    return p


def workload_spec(args: argparse.Namespace):
    if args.workload == "multiround":
        return wl.MultiRoundSpec(args.users, args.rounds, args.system_words, args.turn_words, args.max_tokens,
                                 args.seed, args.sessions)
    if args.workload == "qa":
        return wl.QASpec(args.data, args.docs, args.questions, args.doc_chars, args.order, args.max_tokens, args.seed)
    return wl.TraceSpec(args.data, args.requests, args.block_tokens, args.max_prompt_tokens, args.max_tokens,
                        args.timestamps, args.speed, conversations=args.conversations, min_turns=args.min_turns,
                        max_turns=args.max_turns, seed=args.seed, sessions=args.sessions)


WORKLOAD_FUNCS = wl.WORKLOADS


def bench(targets: list[Target], workload: str, spec, concurrency: int = 1, interleave: bool = False):
    """Run ``workload`` against each target; returns their RunResults, in the order of ``targets``.

    By default one target after the other. ``interleave`` runs them side by side behind one shared bound of
    ``concurrency`` requests, so with 1 the targets take turns request by request: load from elsewhere on
    the machine then falls on all of them alike (throughput figures then cover the shared wall time).
    """
    from kvtier.apps.bench.progress import BenchProgress
    from kvtier.apps.bench.runner import run_workload

    func = partial(WORKLOAD_FUNCS[workload], spec=spec)
    total = wl.count(workload, spec)
    with BenchProgress() as progress:
        rows = [progress.row(f"{workload} @ {t.label}", total) for t in targets]
        if not interleave:
            return [asyncio.run(run_workload(t, workload, func, row, concurrency)) for t, row in zip(targets, rows)]

        async def together():
            limit = asyncio.Semaphore(max(1, concurrency))
            return await asyncio.gather(*(run_workload(t, workload, func, row, limit=limit)
                                          for t, row in zip(targets, rows)))

        return list(asyncio.run(together()))


def run(args: argparse.Namespace) -> int:
    from kvtier.apps.bench import report
    from kvtier.apps.bench.launch import cache_on_and_off
    from kvtier.apps.bench.runner import wait_ready

    out = Path(args.out)
    try:
        spec = workload_spec(args)
        targets = [Target.parse(u, args.api_key) for u in args.url]
        if not targets and not args.serve:
            targets = [Target("local", "http://127.0.0.1:8000", args.api_key)]
        with ExitStack() as stack:
            if args.serve:
                started = stack.enter_context(cache_on_and_off(shlex.split(args.serve_args), out))
                targets += [Target(t.label, t.url, args.api_key) for t in started]
            for target in targets:
                asyncio.run(wait_ready(target, args.wait))
            runs = bench(targets, args.workload, spec, args.concurrency, args.interleave)
    except (ConfigError, ValueError, TimeoutError, RuntimeError, OSError) as exc:
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return 2
    report.print_tables(runs)
    config = {"workload": args.workload, "spec": asdict(spec), "targets": [t.url for t in targets],
              "concurrency": args.concurrency}
    report.write_json(runs, out / f"{args.workload}.json", config)
    report.plot(runs, out / f"{args.workload}.png")
    print(f"raw results: {out / (args.workload + '.json')}   plot: {out / (args.workload + '.png')}")
    failed = sum(1 for r in runs for x in r.results if x.status not in (200, 429))
    return 1 if failed else 0
