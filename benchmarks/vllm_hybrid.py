"""Sliding-window and hybrid (SSM + attention) models on vLLM's real OpenAI server, driven by vLLM's own benchmark
client: vLLM alone vs vLLM + kvtier with vLLM's hybrid KV cache manager (HMA) on, and vLLM + kvtier with it off
(how kvtier ran before the connector supported HMA).

Models (random weights, float32, blocks of 32 tokens, eager mode; harness/window_model.py, harness/hybrid_model.py):

* **window**: a Gemma-3-shaped model, every 6th layer full attention, the others attending 96 tokens back:
  by default ``SMALL`` (hidden size 576, 24 layers, about 140M parameters, near SmolLM2-135M's size), or with
  ``--window-model tiny`` the tests' model (hidden size 128, 6 layers), where vLLM's per-step overhead outweighs
  a prefill. vLLM groups either into 1 full-attention and 5 sliding-window KV cache groups. vLLM's prefix cache
  is held to a quarter of what the prefix workload needs in it, counted per arm the way that arm's vLLM
  allocates (HMA on: the full-attention group's blocks plus each sliding group's window; HMA off: every layer's
  blocks for every token), as ``benchmarks/vllm_serve.py`` holds it, or to what vLLM needs to start (one
  request of the longest prompt) where that is more; prompts are prefilled 256 tokens a step. With
  ``--alone-hma-off``, vLLM alone with its hybrid manager off is one more arm: what turning HMA off changes in
  vLLM itself (its cache then holds every random prompt at 4 in flight, the HMA-on arms' one or two).
* **hybrid**: a Granite-4.0-H shape: by default ``SMALL`` (hidden size 576, 24 layers of which 3 attention, Mamba2
  mixers of 36 heads, about 170M parameters), or with ``--hybrid-model tiny`` the tests' model (hidden size 128, 3
  Mamba2 layers and 1 attention layer), whose prefill steps cost little more than vLLM's per-step overhead.
  Every arm prefills one Mamba block (64 tokens; vLLM raises the attention block to it) a step, at most 16
  requests at a time
  (``--max-num-batched-tokens 64 --max-num-seqs 16``): vLLM's CPU build runs its boundary-aligned Mamba prefix
  caching (``mamba_cache_mode: align``), which kvtier's connector needs for hybrids, only so
  (docs/integrations/hybrid.md). The kvtier arm runs with vLLM's prefix caching on in that mode and 256-token
  chunks (4 Mamba blocks); vLLM alone, with the same scheduling, runs with its prefix caching off (Mamba cache mode
  ``none``), so it recomputes every prompt: what ``vllm_serve.py`` gets by holding vLLM's cache small, which for a
  hybrid's Mamba blocks would be guesswork. One more arm, vLLM alone with its prefix caching on in align mode
  (``vLLM alone (align)``), shows what that mode costs vLLM itself. vLLM's own cache is reset before each run; the
  ``vLLM hits`` column shows what it still served within a run (only prompts sharing a prefix in the same run:
  none at ``--medium``, one prompt per prefix). The HMA-off arm is started and its error recorded: vLLM refuses a
  hybrid SSM model without HMA.

Workloads, each at 4 requests in flight, greedy, fixed output lengths: ``prefix_repetition`` (kvtier measured in
steady state: one unmeasured pass fills its memory tier, then vLLM's prefix cache is reset) and ``random``
prompts (never repeated). Reported per run: request throughput, TTFT p50/p99, ITL p99, the share of prompt
tokens kvtier loaded and vLLM's own prefix cache served, vLLM's preemptions; per kvtier arm, the bytes its memory
tier holds per cached token, against a dense model of the same size (window: the same model with HMA off, which
stores every layer's KV for every token; hybrid: every layer's KV as its attention layers', computed). A table,
``results/vllm_hybrid/vllm_hybrid.png`` and ``.json``, and ``RESULT {json}`` with each ratio against vLLM alone
in the same run and its target.

    python benchmarks/vllm_hybrid.py [--quick | --medium] [--models window] [--window-model small|tiny]
                                     [--hybrid-model small|tiny] [--alone-hma-off] [--out results/vllm_hybrid]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from _util import result, stop_children_on_signal  # noqa: E402
from _vllm_hybrid_report import plot, print_table, targets  # noqa: E402
from _vllm_serve_client import dataset_args, server_counter, summarize, vllm_bench  # noqa: E402
from vllm_serve import SERVER_ENV, compare  # noqa: E402

from harness.vllm_server import VllmServer  # noqa: E402
from kvtier.net.ports import free_port  # noqa: E402

BLOCK, CHUNK, WINDOW, WINDOW_GROUPS, FULL_GROUPS = 32, 256, 96, 5, 1
FULL = dict(prefixes=8, prefix_len=2048, suffix_len=64, output_len=16, prompts=24, random_len=1024,
            random_prompts=12, concurrency=4)
#: the full run's prompt lengths, one prompt per prefix, 8 random prompts (the SMALL window model's prefill is slow)
MEDIUM = {**FULL, "prompts": 8, "random_prompts": 8}
QUICK = dict(prefixes=4, prefix_len=512, suffix_len=32, output_len=8, prompts=8, random_len=512, random_prompts=4,
             concurrency=4)
HMA_OFF = ("--disable-hybrid-kv-cache-manager",)
ALONE, KVTIER, KVTIER_OFF = "vLLM alone", "kvtier (HMA on)", "kvtier (HMA off)"
ALONE_OFF = "vLLM alone (HMA off)"
ALONE_ALIGN = "vLLM alone (align)"  # the hybrid with vLLM's own prefix caching on, reset before each run
OFF_ARMS = (KVTIER_OFF, ALONE_OFF)
PREFILL_STEP = 256  # tokens prefilled a step (--max-num-batched-tokens): chunked prefill of the long prompts
MAMBA_BLOCK = 64  # the hybrid's Mamba block: vLLM raises its attention block (32) to the Mamba state's page
HYBRID_SEQS = 16  # at most MAMBA_BLOCK (vLLM's CPU build, align mode); above the 4 in flight


def cache_blocks(size: dict, hma: bool, max_len: int) -> int:
    """A quarter of the blocks vLLM's prefix cache needs to hold every prefix of the workload, or the fewest vLLM
    starts with (one request of ``max_len``), whichever is more. HMA on: a block holds one KV cache group's
    layers (vLLM makes 1 full-attention and 5 sliding-window groups of the 5:1 model), the full-attention group's
    blocks for every token and each sliding group's window (plus the block it straddles). HMA off: a block holds
    every layer, for every token."""
    blocks = -(-(size["prefix_len"] + size["suffix_len"]) // BLOCK)
    if not hma:
        return max(-(-size["prefixes"] * blocks // 4), -(-max_len // BLOCK) + 4)
    quarter = -(-size["prefixes"] * (blocks * FULL_GROUPS + WINDOW_GROUPS * (WINDOW // BLOCK + 1)) // 4)
    # vLLM reserves a sliding group its window plus the tokens in flight (up to two prefill steps)
    one_request = -(-max_len // BLOCK) + WINDOW_GROUPS * (-(-(WINDOW - 1 + 2 * PREFILL_STEP) // BLOCK) + 1)
    return max(quarter, one_request + 4)


class Bench:
    def __init__(self, size: dict, out: Path, work: Path, models: list[str], window_shape: str = "small",
                 alone_hma_off: bool = False, hybrid_shape: str = "small") -> None:
        from harness import hybrid_model, window_model

        self.size, self.out, self.work = size, out, work
        shape = window_model.SMALL if window_shape == "small" else window_model.TINY
        self.hybrid_shape = hybrid_model.SMALL if hybrid_shape == "small" else hybrid_model.TINY
        build = {"window": lambda: window_model.build_tiny_gemma3(work / "window", window=WINDOW, shape=shape),
                 "hybrid": lambda: hybrid_model.build_tiny_hybrid(work / "hybrid", shape=self.hybrid_shape)}
        self.models = {model: str(build[model]()) for model in models}
        self.arms = {"window": (ALONE, KVTIER, KVTIER_OFF) + ((ALONE_OFF,) if alone_hma_off else ()),
                     "hybrid": (ALONE, ALONE_ALIGN, KVTIER, KVTIER_OFF)}
        self.log = out / "client.log"
        self.log.write_text("")
        self.max_len = max(size["prefix_len"] + size["suffix_len"], size["random_len"]) + 64
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.failed: dict[str, str] = {}  # arm -> the error line of a server that could not start
        self.warm: dict[str, dict] = {}  # arm -> its kvtier metrics after the warm-up pass

    def server(self, model: str, label: str) -> VllmServer:
        args = ["--served-model-name", model, "--block-size", str(BLOCK), "--max-model-len", str(self.max_len),
                "--dtype", "float32", "--enforce-eager", "--seed", "0"]
        if label in OFF_ARMS:
            args += HMA_OFF
        if model == "window":
            blocks = cache_blocks(self.size, label not in OFF_ARMS, self.max_len)
            args += ["--num-gpu-blocks-override", str(blocks), "--max-num-batched-tokens", str(PREFILL_STEP),
                     "--max-num-seqs", "16"]
        else:
            args += hybrid_args(label)
        kvtier = None if label in (ALONE, ALONE_OFF, ALONE_ALIGN) else {"chunk_size": CHUNK,
                                              "tiers": [{"kind": "memory", "capacity_bytes": "2GiB"}]}
        log = self.out / f"server-{model}-{re.sub(r'[^a-z]+', '-', label.lower()).strip('-')}.log"
        return VllmServer(self.models[model], free_port(), log, kvtier=kvtier, args=tuple(args), env=SERVER_ENV)

    def dataset(self, workload: str) -> list[str]:
        return dataset_args(workload, self.size)

    def bench(self, server: VllmServer, model: str, workload: str, seed: int) -> dict:
        return vllm_bench(server.url, model, self.models[model], self.dataset(workload), self.size["concurrency"],
                          seed, self.log)

    def run(self, server: VllmServer, model: str, label: str, workload: str, seed: int) -> dict:
        """One measured run after emptying vLLM's prefix cache (kvtier's saves are let finish first)."""
        server.reset_prefix_cache()
        if server.kvtier is not None:
            time.sleep(2.0)
            server.reset_prefix_cache()
        hits, preempted = _hits(server), server_counter(server.url, "vllm:num_preemptions_total")
        own = server_counter(server.url, "vllm:prefix_cache_hits_total")
        load = os.getloadavg()[0]
        raw = self.bench(server, model, workload, seed)
        time.sleep(1.0)  # the last step's kvtier counters reach /metrics with its output
        row = {"model": model, "workload": workload, "label": label, "concurrency": self.size["concurrency"],
               "seed": seed, **summarize(raw), "loadavg": (load + os.getloadavg()[0]) / 2,
               "duration_s": raw["duration"], "_texts": raw["generated_texts"]}
        row["loaded_share"] = (_hits(server) - hits) / row["prompt_tokens"]
        row["device_share"] = (server_counter(server.url, "vllm:prefix_cache_hits_total") - own) / row["prompt_tokens"]
        row["preemptions"] = server_counter(server.url, "vllm:num_preemptions_total") - preempted
        self.rows.append(row)
        return row

    def model_rows(self, stack: ExitStack, model: str) -> None:
        """Start the arms side by side (an arm that cannot start is recorded), warm the kvtier ones on the
        prefix workload, then each workload on each arm in turn."""
        servers = {label: self.server(model, label) for label in self.arms[model]}
        for server in servers.values():
            stack.callback(server.stop)
            server.launch()
        for label, server in list(servers.items()):
            try:
                server.wait_ready()
            except RuntimeError:
                self.failed[f"{model}: {label}"] = error_line(server.log)
                server.stop()
                del servers[label]
        for label, server in servers.items():
            if model == "window":
                blocks = cache_blocks(self.size, label not in OFF_ARMS, self.max_len)
                layers = "one KV cache group's layers" if label not in OFF_ARMS else "every layer"
                self.notes.append(f"window, {label}: vLLM's cache {blocks} blocks of {BLOCK} tokens ({layers} a block)")
            if server.kvtier is not None:
                self.bench(server, model, "prefix", 0)
                time.sleep(2.0)  # the last saves reach the tier
                self.warm[label] = server.metrics()
        for workload, seed in (("prefix", 0), ("random", 100)):
            for label, server in servers.items():
                print(f"{model}: {workload} on {label}", flush=True)
                row = self.run(server, model, label, workload, seed)
                if workload == "prefix" and server.kvtier is not None:
                    row.update(stored_bytes(self.warm[label]))


def hybrid_args(label: str) -> list[str]:
    """The hybrid's scheduling, the same in every arm: one Mamba block (64 tokens) prefilled a step, as vLLM's CPU
    build runs its boundary-aligned Mamba caching only so (docs/integrations/hybrid.md). kvtier needs vLLM's prefix
    caching on in that mode; vLLM alone runs with it off (``mamba_cache_mode`` ``none``), so it recomputes every
    prompt, as ``vllm_serve.py``'s vLLM alone does with its cache held small."""
    args = ["--max-num-batched-tokens", str(MAMBA_BLOCK), "--max-num-seqs", str(HYBRID_SEQS)]
    if label in (ALONE, ALONE_OFF):
        return args + ["--no-enable-prefix-caching"]
    return args + ["--enable-prefix-caching", "--mamba-cache-mode", "align"]


def _hits(server: VllmServer) -> float:
    return server_counter(server.url, "vllm:kvtier_hit_tokens_total") if server.kvtier is not None else 0.0


def stored_bytes(metrics: dict[str, float]) -> dict:
    """Bytes the memory tier holds per token it stored (after the warm-up pass; nothing evicted at 2 GiB)."""
    tokens = metrics.get("kvtier_stored_tokens_total{memory}", 0.0)
    used = metrics.get("kvtier_tier_used_bytes{memory}", 0.0)
    return {"stored_tokens": tokens, "stored_bytes": used, "bytes_per_token": used / tokens if tokens else 0.0}


def error_line(log: Path) -> str:
    """Why a server did not start: the first ``...Error: ...`` line of its log other than vLLM's generic "Engine
    core initialization failed" (the root cause its engine process logged), else the last line."""
    lines = [line.split("] ", 1)[-1].strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"[\w.]*(Error|Exception): ", line)
              and "Engine core initialization failed" not in line]
    return (causes or lines or ["(no output)"])[0 if causes else -1][-400:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="a few-minute smoke run: shorter prompts, fewer")
    sizes.add_argument("--medium", action="store_true", help="the full run's prompt lengths, fewer prompts")
    parser.add_argument("--out", default="results/vllm_hybrid")
    parser.add_argument("--models", default="window,hybrid", help="comma-separated, of window and hybrid")
    parser.add_argument("--window-model", choices=("small", "tiny"), default="small",
                        help="the window model's shape: near SmolLM2-135M's size, or the tests' tiny one")
    parser.add_argument("--hybrid-model", choices=("small", "tiny"), default="small",
                        help="the hybrid's shape: Granite-4.0-H near SmolLM2-135M's size, or the tests' tiny one")
    parser.add_argument("--alone-hma-off", action="store_true", help="add vLLM alone with HMA off (window model)")
    parser.add_argument("--report", metavar="JSON", help="print the table, PNG and RESULT of a saved run again")
    args = parser.parse_args()
    stop_children_on_signal()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        report(json.loads(Path(args.report).read_text()), out)
        return
    size = dict(QUICK if args.quick else MEDIUM if args.medium else FULL)
    models = args.models.split(",")
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-hybrid-") as tmp:
        bench = Bench(size, out, Path(tmp), models, args.window_model, args.alone_hma_off, args.hybrid_model)
        for model in models:
            with ExitStack() as stack:
                bench.model_rows(stack, model)
    rows = []
    for model in models:
        rows += compare([r for r in bench.rows if r["model"] == model])
    from harness.hybrid_model import dense_bytes_per_token

    report({"quick": args.quick, "medium": args.medium, "window_model": args.window_model,
            "hybrid_model": args.hybrid_model, "size": size, "rows": rows, "failed": bench.failed, "notes": bench.notes,
            "dense_hybrid_bytes_per_token": dense_bytes_per_token(shape=bench.hybrid_shape),
            "loadavg_end": os.getloadavg()[0],
            "date": time.strftime("%Y-%m-%d %H:%M")}, out)


def report(run: dict, out: Path) -> None:
    """The table, the PNG, the JSON and the RESULT line of a run (``--report`` re-renders a saved one)."""
    ratios, checks = targets(run)
    print_table(run, ratios)
    plot(run["rows"], out / "vllm_hybrid.png")
    (out / "vllm_hybrid.json").write_text(json.dumps({**run, "ratios": ratios, "targets": checks}, indent=1))
    print(f"plot: {out / 'vllm_hybrid.png'}   raw: {out / 'vllm_hybrid.json'}   client log: {out / 'client.log'}")
    result({"benchmark": "vllm_hybrid", "quick": run["quick"], **{k: round(v, 3) for k, v in ratios.items()},
            "targets": checks, "could_not_start": run["failed"], "loadavg_1m_end": round(run["loadavg_end"], 2)})


if __name__ == "__main__":
    main()
