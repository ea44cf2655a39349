"""Non-prefix reuse on RAG prompts: blending (CacheBlend) against full prefill, prefix caching and naive reuse.

SmolLM2-135M-Instruct on real text: each LooGLE document (``loogle_longdep_qa.jsonl``) is cut into passages of
``--passage-tokens`` tokens; each of its questions gets 4-6 of the document's first ``--passages`` passages,
in a random order, one chat message each, after a fixed system prompt and before the question. A warm-up pass
asks every question once with another order of its passages (so the cache holds the passages as segments, and
the prefix chains of those earlier prompts); the measured pass then runs, per prompt, in one process:

* ``full``: full prefill, no cache (the reference for quality);
* ``prefix``: prefix caching only (kvtier's prefix chains);
* ``naive``: cached segments re-rotated and concatenated, nothing recomputed (r = 0);
* ``blend-5`` .. ``blend-50``: blending, recomputing r = 5, 10, 15, 30, 50 % of the reused tokens.

TTFT is the prefill up to the first token's logits (retrieve + compute), measured in the same process for
every method, methods in a rotating order per prompt; speed-ups are medians of per-prompt ratios. Quality
against the reference, over its greedy answer (``--answer-tokens``): next-token top-1 agreement and KL(ref ||
method) with the reference answer teacher-forced, and whether the method's own greedy answer is identical.
Targets at the default r: TTFT >= 2x faster than prefix caching, top-1 agreement >= 0.95 and clearly above
naive concatenation. Writes a table, ``<out>/blend_rag.json`` and ``<out>/blend_rag.png`` (quality against
TTFT per method); last line: RESULT {json}.

    python benchmarks/blend_rag.py [--docs 5 --questions 3 --threads 1]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import result  # noqa: E402

from kvtier import CacheConfig, KVCache  # noqa: E402
from kvtier.apps.serve.segmenter import Segmenter  # noqa: E402
from kvtier.integrations.blend import BlendConfig, BlendedLM  # noqa: E402
from kvtier.integrations.models import load_model  # noqa: E402
from kvtier.integrations.transformers import GenerationStats, Prefill, PrefixCachedLM, kv_spec, model_identity  # noqa: E402

SYSTEM = "Answer the question using only the documents provided."
RATIOS = (0.05, 0.10, 0.15, 0.30, 0.50)
DEFAULT_RATIO = BlendConfig().recompute_ratio
TARGET_SPEEDUP, TARGET_TOP1 = 2.0, 0.95


@dataclass
class Case:
    """One RAG prompt: its chat messages, token ids and segment spans."""

    question: str
    ids: list[int]
    spans: tuple[tuple[int, int], ...]


@dataclass
class Scores:
    """One method on one prompt."""

    ttft_s: float
    top1: float
    kl: float
    identical: bool
    cached: int
    blended: int
    deviation: float  #: what the quality gate measured (blending methods)
    gated: bool


@dataclass
class Method:
    name: str
    lm: PrefixCachedLM | None  #: None when re-summarizing a saved run
    blends: bool
    scores: list[Scores] = field(default_factory=list)


def workloads_dir() -> Path:
    env = os.environ.get("KVTIER_WORKLOADS")
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "workloads"


def build_cases(tokenizer, args) -> tuple[list[Case], list[Case]]:
    """Warm-up and measured prompts: the same passages per question, in two different random orders."""
    rng, segmenter = random.Random(args.seed), Segmenter(tokenizer)
    warm, measured = [], []
    with open(workloads_dir() / "loogle_longdep_qa.jsonl", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh][: args.docs]
    for row in rows:
        ids = tokenizer.encode(row["input"], add_special_tokens=False)
        size = args.passage_tokens
        pool = [tokenizer.decode(ids[i : i + size]).strip() for i in range(0, size * args.passages, size)]
        pairs = ast.literal_eval(row["qa_pairs"]) if isinstance(row["qa_pairs"], str) else row["qa_pairs"]
        for pair in pairs[: args.questions]:
            chosen = rng.sample(pool, rng.randint(4, 6))
            for out, order in ((warm, rng.sample(chosen, len(chosen))), (measured, chosen)):
                out.append(make_case(tokenizer, segmenter, order, str(pair["Q"])))
    return warm, measured


def make_case(tokenizer, segmenter: Segmenter, passages: list[str], question: str) -> Case:
    messages = [{"role": "system", "content": SYSTEM}, *({"role": "user", "content": p} for p in passages),
                {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Case(question, ids, segmenter.chat(messages, ids))


def make_methods(model, cache: KVCache) -> list[Method]:
    methods = [Method("full", PrefixCachedLM(model, None), False),
               Method("prefix", PrefixCachedLM(model, cache), False),
               Method("naive", BlendedLM(model, cache, BlendConfig(recompute_ratio=0.0)), True)]
    for ratio in RATIOS:
        lm = BlendedLM(model, cache, BlendConfig(recompute_ratio=ratio))
        methods.append(Method(f"blend-{round(ratio * 100)}", lm, True))
    return methods


def warm_up(model, cache: KVCache, cases: list[Case]) -> None:
    """Earlier requests: their prefix chains (prefix caching) and their passages (segments) get cached."""
    prefix, blend = PrefixCachedLM(model, cache), BlendedLM(model, cache)
    for case in tqdm(cases, desc="warm-up", unit="prompt"):
        prefix.generate(case.ids, 1)
        blend.generate(case.ids, 1, segments=case.spans)


def rewind(prefill: Prefill, n_tokens: int) -> None:
    """Cut the prefill's cache back to the prompt's ``n_tokens`` after decoding from it."""
    extra = prefill.past.get_seq_length() - n_tokens
    if extra > 0:
        prefill.past.crop(-extra)


@torch.inference_mode()
def greedy(model, prefill: Prefill, n: int, stop_ids: set[int]) -> list[int]:
    """The greedy answer after ``prefill`` (extends its cache)."""
    token, out = int(prefill.logits.argmax()), []
    while True:
        out.append(token)
        if token in stop_ids or len(out) == n:
            return out
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=prefill.past, use_cache=True).logits
        token = int(logits[0, -1].argmax())


@torch.inference_mode()
def forced_logits(model, prefill: Prefill, answer: list[int]) -> torch.Tensor:
    """Next-token log-probabilities at each answer position, the answer teacher-forced (extends the cache)."""
    rest = model(input_ids=torch.tensor([answer[:-1]]), past_key_values=prefill.past, use_cache=True).logits[0]
    return torch.log_softmax(torch.cat((prefill.logits[None], rest)).float(), dim=-1)


def run_case(model, case: Case, methods: list[Method], turn: int, args, stop_ids: set[int]) -> None:
    """Every method on one prompt: the reference first, then the others in an order rotated by ``turn``."""
    others = methods[1:]
    others = others[turn % len(others) :] + others[: turn % len(others)]
    reference: tuple[list[int], torch.Tensor] | None = None
    for method in [methods[0], *others]:
        stats = GenerationStats()
        start = time.perf_counter()
        prefill = method.lm.prefill(case.ids, segments=case.spans if method.blends else (), stats=stats)
        ttft = time.perf_counter() - start
        answer = greedy(model, prefill, args.answer_tokens, stop_ids)
        rewind(prefill, len(case.ids))
        if reference is None:
            reference = (answer, forced_logits(model, prefill, answer))
            rewind(prefill, len(case.ids))
        identical = answer == reference[0]
        answer, ref_logp = reference
        logp = forced_logits(model, prefill, answer)
        top1 = float((logp.argmax(-1) == ref_logp.argmax(-1)).float().mean())
        kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
        method.scores.append(Scores(ttft, top1, kl, identical, stats.cached_tokens, stats.blended_tokens,
                                    getattr(prefill, "deviation", 0.0), getattr(prefill, "gated", False)))


def summarize(methods: list[Method], prompt_tokens: int) -> dict[str, dict[str, float]]:
    """Per method: median TTFT, median per-prompt speed-ups against prefix caching and full prefill, quality,
    and the shares of all prompt tokens that came from prefix chains and from blended segments."""
    by_name = {m.name: m for m in methods}
    out = {}
    for method in methods:
        s = method.scores
        out[method.name] = {
            "ttft_median_s": statistics.median(x.ttft_s for x in s),
            "speedup_vs_prefix": statistics.median(p.ttft_s / x.ttft_s for p, x in zip(by_name["prefix"].scores, s)),
            "speedup_vs_full": statistics.median(f.ttft_s / x.ttft_s for f, x in zip(by_name["full"].scores, s)),
            "top1": statistics.fmean(x.top1 for x in s),
            "kl": statistics.fmean(x.kl for x in s),
            "identical": sum(x.identical for x in s) / len(s),
            "cached_share": sum(x.cached for x in s) / prompt_tokens,
            "blended_share": sum(x.blended for x in s) / prompt_tokens,
            "gated": sum(x.gated for x in s),
            "deviation_max": max(x.deviation for x in s),
        }
    return out


def print_table(summary: dict[str, dict[str, float]], n_prompts: int) -> None:
    print(f"\n{n_prompts} RAG prompts; TTFT speed-ups are medians of per-prompt ratios")
    print(f"{'method':<10} {'TTFT s':>8} {'vs prefix':>10} {'vs full':>8} {'top-1':>7} {'KL':>8} {'identical':>10} "
          f"{'prefix hit':>10} {'blended':>8}")
    for name, s in summary.items():
        print(f"{name:<10} {s['ttft_median_s']:8.3f} {s['speedup_vs_prefix']:9.2f}x {s['speedup_vs_full']:7.2f}x "
              f"{s['top1']:7.3f} {s['kl']:8.4f} {s['identical']:10.2f} {s['cached_share']:10.1%} "
              f"{s['blended_share']:8.1%}")


def plot(summary: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top1_ax, kl_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, s in summary.items():
        for ax, key in ((top1_ax, "top1"), (kl_ax, "kl")):
            ax.scatter(s["ttft_median_s"], s[key], s=40)
            ax.annotate(name, (s["ttft_median_s"], s[key]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    top1_ax.axhline(TARGET_TOP1, color="grey", linestyle=":", linewidth=1)
    top1_ax.set(xlabel="median TTFT (s)", ylabel="top-1 agreement with full prefill", title="agreement vs TTFT")
    kl_ax.set(xlabel="median TTFT (s)", ylabel="KL(full || method), nats", title="KL vs TTFT")
    fig.suptitle("SmolLM2-135M-Instruct, LooGLE RAG prompts: blending vs prefix caching vs full prefill")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=5, help="LooGLE documents (5 in the file)")
    p.add_argument("--questions", type=int, default=3, help="questions per document")
    p.add_argument("--passages", type=int, default=8, help="passages per document each question draws from")
    p.add_argument("--passage-tokens", type=int, default=300)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/blend_rag")
    p.add_argument("--summarize", metavar="JSON", help="only re-summarize a run's blend_rag.json (no model run)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        run = json.loads(Path(args.summarize).read_text())
        records, prompt_tokens = run["prompts"], run["prompt_tokens"]
    else:
        records, prompt_tokens = measure(args)
        (out / "blend_rag.json").write_text(json.dumps({"args": vars(args), "prompt_tokens": prompt_tokens,
                                                       "prompts": records}, indent=1))
    methods = [Method(name, None, False, [Scores(**s) for s in scores]) for name, scores in records.items()]
    summary = summarize(methods, sum(prompt_tokens))
    print_table(summary, len(prompt_tokens))
    plot(summary, out / "blend_rag.png")
    report(summary, len(prompt_tokens), sum(prompt_tokens) / len(prompt_tokens))


def measure(args) -> tuple[dict[str, list[dict]], list[int]]:
    """Run every method on every prompt: per-method score records, and the prompts' lengths."""
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    stop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if i is not None}
    warm, cases = build_cases(tokenizer, args)
    config = CacheConfig(chunk_size=64, tiers=[{"kind": "memory", "capacity_bytes": "3GiB"}])
    with KVCache(kv_spec(model), model_identity(model), config) as cache:
        warm_up(model, cache, warm)
        methods = make_methods(model, cache)
        for turn, case in enumerate(tqdm(cases, desc="measure", unit="prompt")):
            run_case(model, case, methods, turn, args, stop_ids)
    return {m.name: [s.__dict__ for s in m.scores] for m in methods}, [len(c.ids) for c in cases]


def report(summary: dict[str, dict[str, float]], n_prompts: int, mean_tokens: float) -> None:
    """The RESULT line: every method's figures, and the targets at the default r and at each measured r."""
    naive = summary["naive"]
    figures: dict[str, object] = {"prompts": n_prompts, "mean_prompt_tokens": round(mean_tokens),
                                  "default_ratio": DEFAULT_RATIO}
    for name, s in summary.items():
        for key in ("speedup_vs_prefix", "speedup_vs_full", "top1", "kl", "identical"):
            figures[f"{name}_{key}"] = s[key]
    met = []
    for ratio in RATIOS:
        s = summary[f"blend-{round(ratio * 100)}"]
        if s["speedup_vs_prefix"] >= TARGET_SPEEDUP and s["top1"] >= TARGET_TOP1 and s["top1"] > naive["top1"]:
            met.append(ratio)
    figures["ratios_meeting_targets"] = met
    default = summary[f"blend-{round(DEFAULT_RATIO * 100)}"]
    figures["target_speedup_met"] = default["speedup_vs_prefix"] >= TARGET_SPEEDUP
    figures["target_top1_met"] = default["top1"] >= TARGET_TOP1 and default["top1"] > naive["top1"]
    result(figures)


if __name__ == "__main__":
    main()
