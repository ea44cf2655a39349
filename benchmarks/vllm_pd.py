"""Prefill/decode disaggregation on real vLLM servers, driven by vLLM's own benchmark client: the same two
servers as 2 co-located replicas behind ``kvtier route --replica A --replica B``, then as 1 prefill + 1 decode
behind ``kvtier route --prefill A --decode B``.

Both servers are ``kvtier vllm serve`` of SmolLM2-135M-Instruct (float32, blocks of 32 tokens, eager mode, one
OpenMP thread each: they share this machine's cores) with the kvtier connector over a small memory tier and one
real redis-server behind it (chunks of 256 tokens). Both arms run on the very same two processes, so on the same
cores; before each arm vLLM's prefix caches are reset and Redis is emptied. The client is vLLM's benchmark client
(``vllm bench serve``, run in this process), greedy with fixed output lengths:

* **mixed**: long prompts and long answers, never repeated (``--dataset-name random``). The issue's shape is
  4k-8k-token prompts: ``--long`` runs that (6 prompts of 4,000 to 8,000 tokens, SmolLM2's context is 8,192)
  and only this workload; by default the lengths are scaled down to prompts of 1,000 to 2,000 tokens with
  answers of 96 tokens (``--quick`` less), and the script prints the scale it ran.
* **chat**: multi-turn conversations: each user's prompt in round r is its prompt of round r-1, the answer
  (fixed words) and a new turn (``--dataset-name sharegpt``, one file per round, prompts of at most 1,024
  tokens as that client takes); each round is one run of the client with one request per user in flight. The
  co-located router sends a conversation back to the replica that holds its prefix; the prefill pool is one
  replica.

Reported per arm and workload: ITL p50/p99 (every decoding stream's inter-token gaps), TTFT p50/p99, request
throughput, each server's CPU seconds over the workload's wall time (how busy each process kept its core), the
**loaded share** (prompt tokens kvtier loaded instead of computing, over the prompt tokens sent) and the **reused
share** (those and the tokens vLLM's own prefix cache still held). For P/D both count the prefill replica only (the
decode replica loads every prompt: that is the transfer, not reuse; its loaded share is printed apart). The chat
target is read on the reused share: the prefix reuse kept, wherever it hit. Ratios against the issue's targets:
mixed ITL p99 of P/D at most 0.5x the co-located one at no less than 0.8x its throughput; chat loaded share of P/D
at least 0.9x the co-located one. Last line ``RESULT {json}``.

    PYTHONPATH=. python benchmarks/vllm_pd.py [--quick | --long] [--out results/vllm_pd]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from _util import result, router_process, stop_children_on_signal  # noqa: E402
from _vllm_serve_client import server_counter, summarize, vllm_bench  # noqa: E402

from harness.redis_server import RedisServer  # noqa: E402
from harness.vllm_server import VllmServer  # noqa: E402
from kvtier.net.ports import free_port  # noqa: E402

NAME, BLOCK, CHUNK = "smollm2", 32, 256
#: SmolLM2's context (max_position_embeddings): --max-model-len never asks for more
MODEL_LEN = 8192
#: mixed: prompt lengths uniform in ``mixed_len`` +- a third. chat: vLLM's client takes ShareGPT prompts of at
#: most 1,024 tokens, which bounds a conversation's last round
SIZES = {"full": dict(mixed_prompts=12, mixed_len=1500, mixed_out=96, concurrency=4,
                      users=4, rounds=3, context_words=250, turn_words=25, answer_words=15, chat_out=32),
         "quick": dict(mixed_prompts=6, mixed_len=700, mixed_out=48, concurrency=3,
                       users=3, rounds=3, context_words=150, turn_words=20, answer_words=10, chat_out=16),
         # the mixed shape: 4,020-7,980-token prompts; the chat workload is not run (its prompts are bounded
         # by vLLM's ShareGPT client, so --long would not change it)
         "long": dict(mixed_prompts=6, mixed_len=6000, mixed_out=96, concurrency=4, workloads=("mixed",))}
#: every server's environment: one core for the forward pass each (vLLM's CPU build otherwise reserves cores
#: for its scheduler by whether a KV connector is configured); dev mode for /reset_prefix_cache
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
              "OMP_NUM_THREADS": "1"}
WORDS = ("amber quill harbor lantern meadow copper falcon violet thistle beacon saddle quarry river stone cedar "
         "glacier orchard pepper signal timber velvet willow anchor bramble canyon").split()
TARGETS = {"itl_p99_ratio_max": 0.5, "throughput_ratio_min": 0.8, "loaded_share_ratio_min": 0.9}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sharegpt(path: Path, prompts: list[str], out_len: int) -> list[str]:
    """vLLM's client arguments for ``prompts`` as a ShareGPT file (each its own conversation's first turn), in
    order, each answered with ``out_len`` tokens."""
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "ok"}]}
                                for p in prompts]))
    return ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", str(len(prompts)),
            "--sharegpt-output-len", str(out_len), "--disable-shuffle"]


def cpu_seconds(server: VllmServer) -> float:
    """User + system CPU seconds of ``server``'s processes so far (its API server, engine core and workers)."""
    import psutil

    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def reused(server: VllmServer) -> tuple[float, float]:
    """Prompt tokens ``server`` did not compute so far: (loaded by kvtier from any tier, hit in vLLM's own cache)."""
    loaded = sum(v for k, v in server.metrics().items() if k.startswith("kvtier_hit_tokens_total"))
    return loaded, server_counter(server.url, "vllm:prefix_cache_hits_total")


class Bench:
    def __init__(self, size: dict, out: Path) -> None:
        from kvtier.integrations.models import ensure_smollm2

        self.size, self.out = size, out
        self.model = str(ensure_smollm2())
        self.log = out / "client.log"
        self.log.write_text("")
        self.workloads = size.get("workloads", ("mixed", "chat"))
        chat_len = 1024 + size["chat_out"] + 64 if "chat" in self.workloads else 0
        self.max_len = min(max(int(size["mixed_len"] * 1.34) + size["mixed_out"] + 64, chat_len), MODEL_LEN)

    def servers(self, redis: RedisServer) -> list[VllmServer]:
        tiers = [{"kind": "memory", "capacity_bytes": "256MiB"},
                 {"kind": "redis", "url": redis.url, "timeout_s": 20}]
        args = ("--served-model-name", NAME, "--block-size", str(BLOCK), "--max-model-len", str(self.max_len),
                "--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-num-seqs", "8")
        return [VllmServer(self.model, free_port(), self.out / f"server-{label}.log", args=args, env=SERVER_ENV,
                           kvtier={"chunk_size": CHUNK, "tiers": tiers}) for label in ("a", "b")]

    def mixed(self) -> list[str]:
        s = self.size
        return ["--dataset-name", "random", "--num-prompts", str(s["mixed_prompts"]), "--random-input-len",
                str(s["mixed_len"]), "--random-output-len", str(s["mixed_out"]), "--random-range-ratio", "0.33"]

    def chat_rounds(self, seed: int) -> list[list[str]]:
        """Per round, vLLM's client arguments for every user's prompt of that round."""
        s, rng = self.size, random.Random(seed)
        system = "You are a helpful assistant. Notes: " + words(rng, 40)
        texts = [f"{system}\nUser {u}: {words(rng, s['context_words'])}" for u in range(s["users"])]
        rounds = []
        for r in range(s["rounds"]):
            texts = [f"{t}\nUser: {words(rng, s['turn_words'])}\nAssistant:" for t in texts]
            rounds.append(sharegpt(self.out / f"chat-{seed}-round{r}.json", texts, s["chat_out"]))
            texts = [f"{t} {words(rng, s['answer_words'])}" for t in texts]
        return rounds

    def reset(self, servers: list[VllmServer], redis: RedisServer) -> None:
        time.sleep(2.0)  # kvtier's background saves of the last requests
        for server in servers:
            server.reset_prefix_cache()
        redis.flush()

    def arm(self, label: str, flags: list[str], servers: list[VllmServer], redis: RedisServer, seed: int) -> dict:
        """Both workloads through one router; per workload the client's summary and the loaded shares."""
        port = free_port()
        cmd = [sys.executable, "-m", "kvtier", "route", "--port", str(port), "--log-level", "warning",
               "--model", self.model, *flags]
        rows = {}
        with router_process(cmd, f"http://127.0.0.1:{port}", self.out / f"route-{label}.log") as url:
            for workload in self.workloads:
                self.reset(servers, redis)
                before = [reused(s) for s in servers]
                cpu_before, started = [cpu_seconds(s) for s in servers], time.monotonic()
                if workload == "mixed":
                    runs = [vllm_bench(url, NAME, self.model, self.mixed(), self.size["concurrency"], seed, self.log)]
                else:
                    runs = [vllm_bench(url, NAME, self.model, dataset, self.size["users"], seed, self.log)
                            for dataset in self.chat_rounds(seed)]
                loaded = [tuple(x - y for x, y in zip(reused(s), b)) for s, b in zip(servers, before)]
                wall = time.monotonic() - started
                busy = [(cpu_seconds(s) - c) / wall for s, c in zip(servers, cpu_before)]
                rows[workload] = self.summary(label, workload, runs, loaded)
                rows[workload]["busy"] = busy
                print(f"{'':>10} {workload:>6}: CPU s per wall s: server a {busy[0]:.2f}, b {busy[1]:.2f}", flush=True)
        return rows

    def summary(self, label: str, workload: str, runs: list[dict], loaded: list[float]) -> dict:
        merged = {"ttfts": [t for r in runs for t in r["ttfts"]], "itls": [i for r in runs for i in r["itls"]],
                  "input_lens": [n for r in runs for n in r["input_lens"]],
                  "completed": sum(r["completed"] for r in runs),
                  "request_throughput": sum(r["completed"] for r in runs) / sum(r["duration"] for r in runs)}
        row = summarize(merged)
        prompt = max(row["prompt_tokens"], 1)
        # P/D: server a is the prefill replica (its loads and hits are reuse), b the decode one (its loads are the
        # transfer of every prompt, not reuse)
        counted = loaded[:1] if label == "pd" else loaded
        row["loaded_share"] = sum(x[0] for x in counted) / prompt
        row["reused_share"] = sum(x[0] + x[1] for x in counted) / prompt
        row["decode_loaded_share"] = loaded[1][0] / prompt if label == "pd" else 0.0
        row.update(arm=label, workload=workload, load=os.getloadavg()[0])
        print(f"{label:>10} {workload:>6}: {row['req_s']:.3f} req/s  TTFT p50 {row['ttft_p50'] * 1e3:.0f} "
              f"p99 {row['ttft_p99'] * 1e3:.0f} ms  ITL p50 {row['itl_p50'] * 1e3:.1f} p99 "
              f"{row['itl_p99'] * 1e3:.1f} ms  loaded {row['loaded_share']:.3f} reused {row['reused_share']:.3f}"
              + (f" (decode {row['decode_loaded_share']:.3f})" if label == "pd" else "") + f"  load {row['load']:.1f}",
              flush=True)
        return row


def ratios(colo: dict, pd: dict) -> dict:
    """P/D over co-located, for the workloads both arms ran, with the targets met or not."""
    out = {"mixed_itl_p99_ratio": pd["mixed"]["itl_p99"] / colo["mixed"]["itl_p99"],
           "mixed_itl_p50_ratio": pd["mixed"]["itl_p50"] / colo["mixed"]["itl_p50"],
           "mixed_throughput_ratio": pd["mixed"]["req_s"] / colo["mixed"]["req_s"],
           "mixed_ttft_p50_ratio": pd["mixed"]["ttft_p50"] / colo["mixed"]["ttft_p50"]}
    out["itl_target_met"] = (out["mixed_itl_p99_ratio"] <= TARGETS["itl_p99_ratio_max"]
                             and out["mixed_throughput_ratio"] >= TARGETS["throughput_ratio_min"])
    if "chat" in pd:
        out.update({"chat_itl_p99_ratio": pd["chat"]["itl_p99"] / colo["chat"]["itl_p99"],
                    "chat_throughput_ratio": pd["chat"]["req_s"] / colo["chat"]["req_s"],
                    "chat_loaded_share_ratio": pd["chat"]["loaded_share"] / max(colo["chat"]["loaded_share"], 1e-9),
                    "chat_reused_share_ratio": pd["chat"]["reused_share"] / max(colo["chat"]["reused_share"], 1e-9)})
        # the prefix reuse kept: tokens not computed, whether kvtier loaded them or vLLM's own cache still held them
        out["loaded_share_target_met"] = out["chat_reused_share_ratio"] >= TARGETS["loaded_share_ratio_min"]
    return out


def closing_figures(colo: dict, pd: dict, figures: dict) -> dict:
    """The RESULT line: the ratios, the targets, and the absolute figures they come from."""
    out = {**figures, **{f"target_{k}": v for k, v in TARGETS.items()},
           "colocated_mixed_itl_p99_ms": colo["mixed"]["itl_p99"] * 1e3, "pd_mixed_itl_p99_ms": pd["mixed"]["itl_p99"] * 1e3,
           "colocated_mixed_req_s": colo["mixed"]["req_s"], "pd_mixed_req_s": pd["mixed"]["req_s"],
           "pd_mixed_decode_loaded_share": pd["mixed"]["decode_loaded_share"],
           "pd_mixed_busy_prefill": pd["mixed"]["busy"][0], "pd_mixed_busy_decode": pd["mixed"]["busy"][1]}
    if "chat" in pd:
        out.update({f"{arm}_chat_{share}": rows["chat"][share] for arm, rows in (("colocated", colo), ("pd", pd))
                    for share in ("loaded_share", "reused_share")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_true")
    scale.add_argument("--long", action="store_true", help="the mixed workload only, at 4k-8k-token prompts")
    parser.add_argument("--out", default="results/vllm_pd")
    args = parser.parse_args()
    stop_children_on_signal()
    size = SIZES["quick" if args.quick else "long" if args.long else "full"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(size, out)
    chat = f"; chat: {size['users']} users x {size['rounds']} rounds" if "chat" in bench.workloads else ""
    print(f"mixed prompts of {size['mixed_len']} tokens +- 1/3 (the issue: 4k-8k) with {size['mixed_out']}-token "
          f"answers, {size['mixed_prompts']} at {size['concurrency']} in flight{chat}", flush=True)
    with ExitStack() as stack:
        # every prompt's KV stays in Redis for the whole arm (float32 SmolLM2: 46 KB a token)
        redis = stack.enter_context(RedisServer(maxmemory="4gb" if args.long else "2gb"))
        servers = bench.servers(redis)
        for server in servers:
            stack.callback(server.stop)
            server.launch()
        for server in servers:
            server.wait_ready()
        a, b = (s.url for s in servers)
        colo = bench.arm("colocated", ["--replica", a, "--replica", b], servers, redis, seed=1)
        pd = bench.arm("pd", ["--prefill", a, "--decode", b], servers, redis, seed=1)
    figures = ratios(colo, pd)
    for key, value in figures.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    (out / "vllm_pd.json").write_text(json.dumps({"size": size, "colocated": colo, "pd": pd, "ratios": figures},
                                                 indent=1))
    result(closing_figures(colo, pd, figures))


if __name__ == "__main__":
    main()
