"""Multi-round chat TTFT through `kvtier serve`: kvtier vs the same server with the cache off.

Starts two real `kvtier serve` processes on the default model (SmolLM2-135M-Instruct), one with kvtier's
memory tier and one with `--no-cache`, and drives the same multi-round conversations through both: N users
share a long system prompt, each user's history grows round by round (their turns plus the model's
replies). TTFT is measured on the client, from sending the request to the first streamed text. The two
servers take turns request by request, so load from elsewhere on a shared machine falls on both alike.

Per round it prints the median TTFT of each server and the speed-up (cache-off TTFT / kvtier TTFT), and
checks that both servers produced the same greedy replies. Target: >= 5x once a user's history passes
4,096 tokens. Last line: RESULT {json}.

    PYTHONPATH=. python benchmarks/serve_multiround.py [--users 1 --rounds 4] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from pathlib import Path

from kvtier.apps.bench import report
from kvtier.apps.bench.cli import bench
from kvtier.apps.bench.launch import cache_on_and_off
from kvtier.fleet.workloads import MultiRoundSpec

TARGET_SPEEDUP = 5.0
LONG_HISTORY = 4096


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--users", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-words", type=int, default=3500, help="shared system prompt (~1.1 tokens a word)")
    p.add_argument("--turn-words", type=int, default=150, help="words each user adds per round")
    p.add_argument("--max-tokens", type=int, default=16, help="reply tokens per round")
    p.add_argument("--model", help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--serve-args", default="--memory-bytes 1GiB --threads 1",
                   help="extra kvtier serve arguments (one torch thread: the machine is shared)")
    p.add_argument("--out", default="results/serve_multiround")
    args = p.parse_args()

    spec = MultiRoundSpec(args.users, args.rounds, args.system_words, args.turn_words, args.max_tokens)
    serve_args = shlex.split(args.serve_args) + (["--model", args.model] if args.model else [])
    out = Path(args.out)
    with cache_on_and_off(serve_args, out) as targets:
        on, off = bench(targets, "multiround", spec, interleave=True)  # take turns: same load on both
    report.print_tables([on, off])
    report.write_json([on, off], out / "multiround.json", {"spec": spec.__dict__, "serve_args": serve_args})
    report.plot([on, off], out / "multiround.png")

    failed = [r for r in on.results + off.results if r.status != 200]
    def answers(results):
        return sorted((r.round, r.user, r.text) for r in results)

    same = answers(on.results) == answers(off.results)
    ttft_on, ttft_off, prompts = report.ttft_by_round(on), report.ttft_by_round(off), report.prompt_by_round(on)
    rounds = sorted(set(ttft_on) & set(ttft_off))
    speedups = {k: ttft_off[k] / ttft_on[k] for k in rounds}
    long = [speedups[k] for k in rounds if prompts.get(k, 0) > LONG_HISTORY]
    print(f"plot: {out / 'multiround.png'}   raw: {out / 'multiround.json'}")
    if not same:
        print("WARNING: kvtier and cache-off replies differ (greedy decoding should make them identical)")
    result = {
        "benchmark": "serve_multiround", "model": args.model or "SmolLM2-135M-Instruct", "users": args.users,
        "rounds": args.rounds, "prompt_tokens_by_round": [round(prompts[k]) for k in rounds],
        "ttft_ms_kvtier_by_round": [round(ttft_on[k] * 1000, 1) for k in rounds],
        "ttft_ms_nocache_by_round": [round(ttft_off[k] * 1000, 1) for k in rounds],
        "speedup_by_round": [round(speedups[k], 2) for k in rounds],
        "speedup_past_4k_min": round(min(long), 2) if long else None,
        "speedup_past_4k_median": round(statistics.median(long), 2) if long else None,
        "target_speedup": TARGET_SPEEDUP, "met": bool(long) and min(long) >= TARGET_SPEEDUP,
        "cached_share_kvtier": round(report.summarize(on)["cached_share"], 3),
        "replies_identical": same, "failed_requests": len(failed),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
