"""The fleet's front door: `kvtier route` (1 process and --workers 2) against vllm-router and sglang-router.

All routers stand in front of the same fast stand-in OpenAI replicas (harness.stub_replica), each router pinned
to the same cores (`taskset`, --router-cpus), the replicas and the client on the others, the arms interleaved
round by round so the load other jobs put on this shared machine falls on each alike. Per arm:

* rate: the closed-loop maximum (``--concurrency`` clients, each sending a session's next turn of a chat with a
  ~``--system-tokens`` system prompt as soon as the last was answered; an open-loop search for the rate held
  at p99 < 20 ms takes too long on this shared 2-core machine), its p99 latency, the router's CPU seconds per
  request (its process tree's utime + stime) and RSS;
* oracle share: the Mooncake FAST'25 multi-turn trace (/work/shared/workloads), each 512-token block id
  expanded into ``--block-words`` deterministic words (scaled down so a run fits here), sent in order as text
  completions; the share of requests sent to a replica holding the longest prefix of blocks among the
  replicas, by an oracle that knows what every replica was sent and models each one's bounded cache (each
  stand-in holds at most ``--replica-blocks`` block prefixes, least recently used dropped, and publishes
  nothing, so a router's record of what it sent where goes stale as a real replica's cache would), with
  ``--trace-concurrency`` requests in flight (each stand-in answers ``--block-ms`` per block it did not hold
  later, so placing a turn away from its prefix costs what a prefill would; one request at a time every router
  scored 1.0: a router sends a prefix back where it sent it, and no other replica holds it), the stand-ins'
  caches emptied first; kvtier's record chunk is scaled as the trace (``--record-chunk``);
* RSS after ``--sessions`` distinct sessions (peers: extrapolated linearly to 1 M);
* kvtier's plateau (``--plateau-cap``): a `kvtier route` with its per-session and per-prompt caps
  (``--max-sessions``, ``--prompt-cache-entries``) set to the cap, flooded with distinct small sessions to
  ``--plateau-factor`` x the cap, RSS read at every half cap: the growth from the cap on is the plateau's
  flatness (measured); its RSS after 1 M sessions is the plateau plus what the default caps hold beyond the
  lowered ones, at the cost per entry measured below the cap, plus any growth still seen past the cap carried
  on linearly to 1 M (on a flat plateau nothing; ``plateau_figures``).

Peers come from a venv of their own (scripts/router-peers-venv.sh; --peers). Prints a table and the ratios
against vllm-router, writes a PNG and JSON under --out; last line RESULT {json}.

    PYTHONPATH=. python benchmarks/router_scale.py [--seconds 8 --rounds 2 --sessions 5000 --trace 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _util import result, stop_children_on_signal  # noqa: E402

from harness.router_load import ChatWorkload, RouterProc, StubFleet, closed_loop  # noqa: E402
from harness.router_trace import oracle_share, session_flood, tree_cpu_rss  # noqa: E402
from harness.vllm_router import PEERS  # noqa: E402
from kvtier.net.ports import free_port  # noqa: E402

TRACE = Path("/work/shared/workloads/mooncake_synthetic_trace.jsonl")


def arms(args, model: str) -> dict[str, callable]:
    """Each arm's command for (port, replica urls, trace): ``trace`` is the oracle's run on the scaled trace."""
    peers = Path(args.peers)
    kvtier = [sys.executable, "-m", "kvtier", "route", "--model", model, "--log-level", "warning"]

    def k(*extra):
        # on the scaled-down trace (a 512-token block is ~28 tokens here) the record's chunk is scaled alike:
        # at full size kvtier's 256-token chunk is half a block, so it sees every shared block
        def cmd(port, urls, trace=False):
            scaled = ["--record-chunk-tokens", str(args.record_chunk)] if trace else []
            return [*kvtier, "--port", str(port), *extra, *scaled, *[a for u in urls for a in ("--replica", u)]]
        return cmd

    out = {"kvtier route": k(), "kvtier route x2": k("--workers", "2")}
    if (peers / "bin/vllm-router").exists():
        out["vllm-router cache_aware"] = lambda port, urls, trace=False: [
            str(peers / "bin/vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
            "--worker-urls", *urls]
    if (peers / "bin/sglang-router").exists():
        out["sglang-router cache_aware"] = lambda port, urls, trace=False: [
            str(peers / "bin/sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy",
            "cache_aware", "--worker-urls", *urls]
    return out


def measure(name: str, cmd, fleet: StubFleet, args, out: Path, last: bool) -> dict:
    """One round of one arm: the closed-loop rate; in the last round also ``trace_and_flood``."""
    port = free_port()
    with RouterProc(cmd(port, fleet.urls), port, log=out / f"{name.replace(' ', '_')}.log",
                    cpus=args.router_cpus) as router:
        router.wait_ready("/health", timeout=300)
        asyncio.run(closed_loop(router.url, ChatWorkload(seed=99), args.concurrency, 1.0))  # warm up
        cpu0, _ = tree_cpu_rss(router.pid)
        workload = ChatWorkload(seed=len(name), system_tokens=args.system_tokens)
        load = asyncio.run(closed_loop(router.url, workload, args.concurrency, args.seconds))
        cpu1, rss = tree_cpu_rss(router.pid)
        got = {"rate": load.rate, "p99_ms": load.quantile(0.99) * 1e3, "p50_ms": load.quantile(0.5) * 1e3,
               "cpu_ms_per_request": (cpu1 - cpu0) * 1e3 / max(load.ok, 1), "rss_mb": rss / 2**20,
               "errors": load.sent - load.ok}
    if last:
        got.update(trace_and_flood(name, cmd, fleet, args, out))
    return got


def trace_and_flood(name: str, cmd, fleet: StubFleet, args, out: Path) -> dict:
    """The oracle shares and the RSS after a flood of sessions, through a router process of their own (kvtier's
    with its record's chunk scaled to the trace)."""
    port = free_port()
    with RouterProc(cmd(port, fleet.urls, trace=True), port, log=out / f"{name.replace(' ', '_')}.trace.log",
                    cpus=args.router_cpus) as router:
        router.wait_ready("/health", timeout=300)
        got = {}
        shared = oracle_share(router.url, TRACE, args.trace, args.block_words, fleet.ports,
                              args.replica_blocks or None, concurrency=args.trace_concurrency)
        got.update({"oracle_share": shared.share, "oracle_judged": shared.judged,
                    "oracle_busiest_over_mean": shared.busiest_over_mean})
        _, rss0 = tree_cpu_rss(router.pid)
        sent = session_flood(router.url, args.sessions, args.concurrency)
        _, rss1 = tree_cpu_rss(router.pid)
        got.update({"sessions": sent, "rss_after_sessions_mb": rss1 / 2**20,
                    "rss_1m_sessions_mb": (rss0 + max(rss1 - rss0, 0) * 1e6 / max(sent, 1)) / 2**20})
        return got


def plateau(fleet: StubFleet, args, model: str, out: Path) -> dict:
    """RSS of one kvtier route through a flood of distinct sessions past its (lowered) caps; see the docstring."""
    cap, port = args.plateau_cap, free_port()
    cmd = [sys.executable, "-m", "kvtier", "route", "--model", model, "--log-level", "warning", "--port", str(port),
           "--max-sessions", str(cap), "--prompt-cache-entries", str(cap),
           *sum((["--replica", u] for u in fleet.urls), [])]
    step = max(cap // 2, 1)
    curve: list[tuple[int, float]] = []
    with RouterProc(cmd, port, log=out / "plateau.log", cpus=args.router_cpus) as router:
        router.wait_ready("/health", timeout=300)
        session_flood(router.url, 200, args.concurrency, start=10**9)  # warm: every code path once
        curve.append((0, tree_cpu_rss(router.pid)[1] / 2**20))
        sent = 0
        while sent < args.plateau_factor * cap:
            sent += session_flood(router.url, step, args.concurrency, start=sent)
            curve.append((sent, tree_cpu_rss(router.pid)[1] / 2**20))
    return plateau_figures(curve, cap)


def plateau_figures(curve: list[tuple[int, float]], cap: int, defaults: int = 100_000) -> dict:
    """From RSS ``curve`` [(sessions, MB)] of a router whose caps are ``cap``: its growth per session below and
    past the cap, and RSS after 1 M sessions at the default caps (``defaults``: --max-sessions's; the prompt
    cache's 65,536 is smaller): the last reading, plus what the default caps hold beyond ``cap`` at the cost
    below it, plus whatever still grew past the cap carried on linearly to 1 M (zero on a flat plateau)."""
    n_cap, at_cap = next((n, rss) for n, rss in curve if n >= cap)
    last_n, last = curve[-1]
    below = (at_cap - curve[0][1]) / max(n_cap, 1)
    past = max(last - at_cap, 0.0) / max(last_n - n_cap, 1)
    bound = last + below * max(defaults - cap, 0) + past * max(1_000_000 - last_n, 0)
    return {"plateau_curve": curve, "plateau_cap": cap, "rss_at_cap_mb": at_cap,
            "rss_growth_past_cap_mb": last - at_cap, "mb_per_session_below_cap": below,
            "mb_per_session_past_cap": past, "rss_1m_sessions_mb": bound}


def table(figures: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="routers in front of 4 stand-in replicas")
    cols = ["rate", "p99_ms", "cpu_ms_per_request", "rss_mb", "oracle_share", "oracle_busiest_over_mean",
            "rss_1m_sessions_mb"]
    t.add_column("router")
    for col in cols:
        t.add_column(col, justify="right")
    for name, f in figures.items():
        t.add_row(name, *(f"{f[c]:.3g}" if isinstance(f.get(c), float) else str(f.get(c, "-")) for c in cols))
    Console().print(t)


def plot(figures: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(figures)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, label) in zip(axes, [("rate", "req/s (closed loop)"), ("cpu_ms_per_request", "CPU ms / request"),
                                       ("rss_1m_sessions_mb", "RSS after 1 M sessions (MB; kvtier: plateau)")]):
        ax.bar(range(len(names)), [figures[n].get(key, 0) for n in names])
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--seconds", type=float, default=8.0, help="per arm and round of the rate measurement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--sessions", type=int, default=5000, help="distinct sessions before the RSS reading")
    p.add_argument("--plateau-cap", type=int, default=20_000, help="kvtier's session and prompt caps in the flood")
    p.add_argument("--plateau-factor", type=float, default=3.0, help="flood this many times the cap")
    p.add_argument("--trace", type=int, default=300, help="requests of the multi-turn trace for the oracle share")
    p.add_argument("--replica-blocks", type=int, default=500,
                   help="block prefixes each stand-in holds (LRU; 0: unbounded, every router then matches the oracle)")
    p.add_argument("--block-words", type=int, default=24, help="words each 512-token trace block becomes")
    p.add_argument("--trace-concurrency", type=int, default=8, help="trace requests in flight for the oracle share")
    p.add_argument("--record-chunk", type=int, default=16, help="kvtier's --record-chunk-tokens on the trace")
    p.add_argument("--block-ms", type=float, default=2.0,
                   help="a stand-in's delay per trace block it did not hold (its prefill)")
    p.add_argument("--router-cpus", default="0", help="taskset cores of every router")
    p.add_argument("--other-cpus", default=None, help="taskset cores of the replicas and the client")
    p.add_argument("--peers", default=str(PEERS), help="venv of the peer routers (scripts/router-peers-venv.sh)")
    p.add_argument("--model", help="tokenizer folder for kvtier route (default: the packaged SmolLM2)")
    p.add_argument("--out", default="results/router_scale")
    args = p.parse_args()
    stop_children_on_signal()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.other_cpus is None:
        cores = os.sched_getaffinity(0) - {int(c) for c in args.router_cpus.split(",")}
        args.other_cpus = ",".join(map(str, sorted(cores))) or None
    if args.other_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.other_cpus.split(",")})
    from kvtier.integrations.models import ensure_smollm2

    model = args.model or str(ensure_smollm2())
    routers = arms(args, model)
    figures: dict[str, dict] = {name: {} for name in routers}
    from tqdm import tqdm

    steps = [(r, name) for r in range(args.rounds) for name in routers]  # interleaved: each round every arm
    with StubFleet(args.replicas, cpus=args.other_cpus, blocks=args.replica_blocks or None,
                   block_ms=args.block_ms) as fleet:
        for r, name in tqdm(steps, desc="router_scale"):
            got = measure(name, routers[name], fleet, args, out, last=r == args.rounds - 1)
            for key, value in got.items():
                figures[name].setdefault(key + "_all", []).append(value)
                figures[name][key] = max(figures[name].get(key, value), value) if key == "rate" else value
        k = figures["kvtier route"]
        k["rss_1m_sessions_mb_extrapolated"] = k.get("rss_1m_sessions_mb")  # the linear one, for comparison
        k.update(plateau(fleet, args, model, out))
    table(figures)
    base = figures.get("vllm-router cache_aware", {})
    ratios = {}
    for name, f in figures.items():
        if base:
            ratios[name] = {k: f[k] / base[k] for k in ("rate", "cpu_ms_per_request", "oracle_share")
                            if f.get(k) and base.get(k)}
            print(f"{name}: vs vllm-router " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios[name].items()))
    scaling = figures["kvtier route x2"]["rate"] / figures["kvtier route"]["rate"]
    print(f"kvtier route --workers 2 / 1 process: {scaling:.2f}x (router cores: {args.router_cpus})")
    (out / "router_scale.json").write_text(json.dumps({"figures": figures, "ratios": ratios}, indent=1))
    plot(figures, out / "router_scale.png")
    summary = {f"{n.replace(' ', '_')}_{k}": v for n, f in figures.items() for k, v in f.items()
               if not k.endswith("_all")}
    summary.update({f"{n.replace(' ', '_')}_rate_vs_vllm_router": r.get("rate") for n, r in ratios.items()})
    summary["kvtier_workers2_scaling"] = scaling
    result(summary)


if __name__ == "__main__":
    main()
