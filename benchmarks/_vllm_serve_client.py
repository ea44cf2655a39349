"""benchmarks/vllm_serve.py's clients: vLLM's own benchmark client (``vllm bench serve``, run in this process),
and a streaming probe that times other users' tokens while one request loads a long prefix."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np


def vllm_bench(url: str, name: str, tokenizer: str, dataset: list[str], concurrency: int, seed: int,
               log: Path) -> dict:
    """One run of vLLM's benchmark client (the code behind ``vllm bench serve``) against ``url``: greedy,
    fixed output lengths, no warm-up or test request before it. Its report goes to ``log``; returns its
    result dict (``request_throughput``, ``ttfts`` and ``itls`` in seconds, ``input_lens``, ...)."""
    from kvtier.integrations.vllm.cli import ensure_vllm_metadata

    ensure_vllm_metadata()  # vLLM's CPU build: platform detection reads the `vllm` distribution's version
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--model", name, "--tokenizer", tokenizer,
        "--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos", "--temperature", "0",
        "--disable-tqdm", "--ready-check-timeout-sec", "0", "--num-warmups", "0", "--save-detailed",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99", *dataset])
    with open(log, "a") as out, contextlib.redirect_stdout(out):
        print(f"\n===== {url} concurrency {concurrency} seed {seed}: {' '.join(dataset)}", flush=True)
        result = main(args)
    if result.get("failed"):
        errors = [e for e in result.get("errors", []) if e][:3]
        raise RuntimeError(f"{result['failed']} requests of vLLM's benchmark client failed: {errors}")
    return result


def dataset_args(workload: str, s: dict) -> list[str]:
    """vLLM's benchmark client arguments for ``workload``: ``prefix`` (its ``prefix_repetition`` dataset) or
    anything else (``random``), sized by ``s`` (prompts, prefix_len, suffix_len, prefixes, output_len,
    random_prompts, random_len)."""
    if workload == "prefix":
        return ["--dataset-name", "prefix_repetition", "--num-prompts", str(s["prompts"]),
                "--prefix-repetition-prefix-len", str(s["prefix_len"]),
                "--prefix-repetition-suffix-len", str(s["suffix_len"]),
                "--prefix-repetition-num-prefixes", str(s["prefixes"]),
                "--prefix-repetition-output-len", str(s["output_len"])]
    return ["--dataset-name", "random", "--num-prompts", str(s["random_prompts"]),
            "--random-input-len", str(s["random_len"]), "--random-output-len", str(s["output_len"]),
            "--random-range-ratio", "0"]


def summarize(result: dict) -> dict:
    """Throughput and TTFT / ITL percentiles (seconds) from the client's per-request lists."""
    ttfts = np.array(result["ttfts"], dtype=float)
    itls = np.array([x for per in result["itls"] for x in per], dtype=float)
    return {"req_s": result["request_throughput"], "ttft_p50": float(np.percentile(ttfts, 50)),
            "ttft_p99": float(np.percentile(ttfts, 99)),
            "itl_p50": float(np.percentile(itls, 50)) if itls.size else float("nan"),
            "itl_p99": float(np.percentile(itls, 99)) if itls.size else float("nan"),
            "prompt_tokens": int(sum(result["input_lens"])), "requests": int(result["completed"])}


def _stream(url: str, name: str, prompt: list[int], max_tokens: int, times: list[float],
            stop: threading.Event) -> None:
    """Stream one greedy completion, appending each token's arrival time, until done or ``stop`` is set (the
    connection is then closed, which aborts the request in vLLM)."""
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if stop.is_set():
                return
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())


def itl_under_load(url: str, name: str, loads: list[list[int]], streams: list[list[int]], *, max_tokens: int,
                   quiet_s: float, gap_s: float) -> dict:
    """Start ``streams`` (greedy streamed completions); once each has produced tokens for ``quiet_s`` seconds,
    send each prompt of ``loads`` (one token each, its prefix held by kvtier) and then the same prompt again (a
    control: vLLM's own prefix cache now holds the prefix, so the same prefill runs without a load), one request
    after another ``gap_s`` apart. The streams' inter-token latencies are split into those that overlap a load
    request (from its send to its answer), a control request, or neither ("quiet")."""
    stop = threading.Event()
    times: list[list[float]] = [[] for _ in streams]
    threads = [threading.Thread(target=_stream, args=(url, name, p, max_tokens, t, stop), daemon=True)
               for p, t in zip(streams, times)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 300
    while min(len(t) for t in times) < 3:
        if time.monotonic() > deadline or not all(th.is_alive() for th in threads):
            stop.set()
            raise RuntimeError("the background streams did not start")
        time.sleep(0.05)
    time.sleep(quiet_s)
    windows: dict[str, list[tuple[float, float]]] = {"loading": [], "control": []}
    load_s = []
    with httpx.Client(timeout=600) as client:
        for prompt in loads:
            for kind in ("loading", "control"):
                start = time.perf_counter()
                resp = client.post(f"{url}/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 1,
                                                                  "temperature": 0})
                resp.raise_for_status()
                end = time.perf_counter()
                windows[kind].append((start, end))
                if kind == "loading":
                    load_s.append(end - start)
                time.sleep(gap_s)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    gaps: dict[str, list[float]] = {"loading": [], "control": [], "quiet": []}
    for t in times:
        for a, b in zip(t[1:], t[2:]):  # from the second token on: the first gap includes a prefill
            kind = next((k for k, w in windows.items() if any(a < end and b > start for start, end in w)), "quiet")
            gaps[kind].append(b - a)
    if not all(gaps.values()):
        raise RuntimeError("no inter-token latency fell inside a load, a control or neither")
    p99 = {k: float(np.percentile(v, 99)) for k, v in gaps.items()}
    return {"itl_p99_quiet": p99["quiet"], "itl_p99_loading": p99["loading"], "itl_p99_control": p99["control"],
            "itl_p50_quiet": float(np.percentile(gaps["quiet"], 50)),
            "itl_p50_loading": float(np.percentile(gaps["loading"], 50)),
            "ratio": p99["loading"] / p99["quiet"], "ratio_control": p99["control"] / p99["quiet"],
            "samples_loading": len(gaps["loading"]), "samples_quiet": len(gaps["quiet"]),
            "samples_control": len(gaps["control"]), "load_request_s": float(np.median(load_s))}



def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) the server process ``pid`` and its descendants have used so far, all threads
    (``total``) and kvtier's own threads (``kvtier``: those the connector names ``kvtier-*``, and the threads
    they started, which inherit the name; kvtier.integrations.vllm.threads), and ``by:PROCESS/THREAD`` per
    process and thread name, read from /proc. The hooks kvtier runs on vLLM's own threads are in ``total`` and
    under vLLM's names only. Zeros where /proc is missing."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    cpu = {"total": 0.0, "kvtier": 0.0}
    for p, tids in _process_tree(pid):
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{p}/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            cpu["total"] += seconds
            key = f"by:{_comm(f'/proc/{p}/comm')}/{comm}"  # process name / thread name
            cpu[key] = cpu.get(key, 0.0) + seconds
            if comm.startswith("kvtier-"):
                cpu["kvtier"] += seconds
    return cpu


def _process_tree(pid: int):
    """Yield ``(pid, thread ids)`` for ``pid`` and every process below it, from /proc; gone ones are skipped."""
    import os

    seen, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
            for tid in tids:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
        yield p, tids


def _comm(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def cpu_delta(before: dict[str, float], after: dict[str, float], requests: int) -> dict:
    """Row fields from two :func:`server_cpu` readings: the server's CPU seconds per request, kvtier's threads',
    and ``cpu_by`` (per ``process/thread`` name, the ones that used any)."""
    per = {k: (v - before.get(k, 0.0)) / requests for k, v in after.items()}
    return {"cpu_s_per_req": per["total"], "kvtier_cpu_s_per_req": per["kvtier"],
            "cpu_by": {k[3:]: round(v, 4) for k, v in per.items() if k.startswith("by:") and v > 0}}


def server_counter(url: str, prefix: str) -> float:
    """The sum of every sample of a Prometheus counter whose name starts with ``prefix`` on ``url``/metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


def omp_binding(pid: int) -> str:
    """The OpenMP threads and places vLLM gave the forward pass of the server ``pid`` (its processes' environment:
    vLLM's CPU build sets them for its workers), e.g. ``OMP_NUM_THREADS=1 OMP_PLACES={0}``; ``?`` if unreadable."""
    found = set()
    for p, _ in _process_tree(pid):
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"OMP_PLACES" in env or b"OMP_NUM_THREADS" in env:
            found.add(" ".join(f"{k}={env[k.encode()].decode()}" for k in ("OMP_NUM_THREADS", "OMP_PLACES")
                               if k.encode() in env))
    return "; ".join(sorted(found)) or "?"
