"""State snapshot policies on the multi-round chat workload: hit ratio and stored bytes per cached token.

A snapshot of an SSM model's state is large and of fixed size (Granite-4.0-H-350M's shape: 21 MiB; pure
Mamba2-370m's: 49 MiB), against 4 KiB of attention KV per token for that hybrid. Storing one at every chunk
boundary gives the most hits and costs the most bytes; fewer snapshots cost hits where later prompts share a
prefix that ends between them. This measures each policy on the requests of ``kvtier bench``'s multi-round
workload (its generator, unchanged: users sharing a system prompt, each round appending an answer and a new
question), and on its long-document QA workload (LooGLE documents, several questions each; skipped when the
file is not found), against the limit an attention-only model reaches (every shared full chunk is a hit).

Each request runs through a real KVCache (memory tier, 256-token chunks) exactly as StatefulPrefixCachedLM
drives it: restore the longest prefix whose KV and snapshot are cached (leaving one token to compute), store
the KV of every full chunk, store snapshots where the policy says. Model shapes come from probing the real
transformers models (built on the meta device: no weights, no compute); payloads are zeros of those shapes,
prompts are the SmolLM2 tokenizer's, answers are 60 generated words (no model runs).

    python benchmarks/hybrid_snapshots.py [--users 4 --rounds 8] [--policies every,every-4,last,last+every-4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import result  # noqa: E402
from hybrid_ttft import granite_h_350m, smollm2_360m  # noqa: E402

from kvtier import CacheConfig, KVCache, KVSpec  # noqa: E402
from kvtier.base.errors import ConfigError  # noqa: E402
from kvtier.base.state import ModelStateSpec, SnapshotPolicy  # noqa: E402
from kvtier.fleet.workloads import (  # noqa: E402
    MultiRoundSpec,
    QASpec,
    count,
    find_workload_file,
    longdoc_qa,
    multiround,
    words,
)

CHUNK = 256
ANSWER_WORDS = 60


def mamba2_370m():
    from transformers import Mamba2Config

    return Mamba2Config(vocab_size=50288, hidden_size=1024, num_hidden_layers=48, state_size=128, expand=2,
                        head_dim=64, num_heads=32, n_groups=1, conv_kernel=4, chunk_size=256)


#: The SSM models measured, by name: their configs (shapes only matter here).
MODELS = {"granite-4.0-h-350m": granite_h_350m, "mamba2-370m": mamba2_370m}


def probed_spec(config) -> KVSpec | ModelStateSpec:
    """The cache spec of a model built from ``config`` on the meta device (shapes only)."""
    from transformers import AutoModelForCausalLM

    from kvtier.integrations.transformers import cache_spec

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    return cache_spec(model)


@dataclass
class Replay:
    """Serves requests against one KVCache the way the transformers integration does, and counts."""

    cache: KVCache
    policy: SnapshotPolicy | None  #: None for an attention-only model
    prompt_tokens: int = 0
    hit_tokens: int = 0
    chunks: set = field(default_factory=set)

    def serve(self, prompt: list[int]) -> None:
        size, cache = CHUNK, self.cache
        if self.policy is None:
            hit = cache.retrieve(prompt, max_tokens=len(prompt) - 1)[1]
        else:
            hit = cache.retrieve_states(prompt, max_tokens=len(prompt) - 1).tokens
        if cache.spec is not None:
            cache.store(prompt, ZeroKV(cache.spec))
        if self.policy is not None:
            zeros = {s.kind: torch.zeros(s.snapshot_shape, dtype=s.dtype) for s in cache.model_spec.states}
            boundaries = self.policy.boundaries(hit // size, len(prompt), size)
            cache.store_states(prompt, {k: zeros for k in boundaries})
        self.prompt_tokens += len(prompt)
        self.hit_tokens += hit
        self.chunks.update(cache.keys(prompt))


class ZeroKV:
    """A KVSource of zeros: only the sizes of stored KV matter here."""

    def __init__(self, spec: KVSpec) -> None:
        self.zeros = spec.empty(CHUNK).zero_()

    def chunk(self, start: int, end: int) -> torch.Tensor:
        return self.zeros[:, :, : end - start]


class LocalRunner:
    """What kvtier bench's workloads call, answered locally: chat template, replay, a generated answer."""

    def __init__(self, replay: Replay, tokenizer, progress: tqdm) -> None:
        self.replay, self.tokenizer, self.progress = replay, tokenizer, progress
        self.rng = random.Random(1)

    async def request(self, path: str, body: dict, **_labels) -> object:
        text = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        self.replay.serve(list(self.tokenizer.encode(text, add_special_tokens=False)))
        self.progress.update(1)
        return Answer(words(self.rng, ANSWER_WORDS))


@dataclass(frozen=True)
class Answer:
    text: str


def run(spec, policy: SnapshotPolicy | None, workload: Workload, tokenizer, label: str) -> dict:
    config = CacheConfig(chunk_size=CHUNK, state_snapshots=policy or SnapshotPolicy(),
                         tiers=[{"kind": "memory", "capacity_bytes": "4GiB", "prefault": False}])
    with KVCache(spec, label, config) as cache, tqdm(total=workload.requests, desc=label, file=sys.stderr,
                                                      leave=False) as progress:
        replay = Replay(cache, policy)
        asyncio.run(workload.run(LocalRunner(replay, tokenizer, progress)))
        used = cache.tiers[0].stats().used_bytes
        snapshots = cache.metrics.total("kvtier_state_snapshots_stored_total") / max(len(cache.model_spec.states), 1)
    cached_tokens = len(replay.chunks) * CHUNK
    return {"hit_ratio": replay.hit_tokens / replay.prompt_tokens, "stored_bytes": used, "snapshots": int(snapshots),
            "bytes_per_cached_token": used / cached_tokens, "prompt_tokens": replay.prompt_tokens}


@dataclass(frozen=True)
class Workload:
    """One of kvtier bench's workloads: its generator, bound to a spec."""

    name: str
    spec: object
    generator: Callable[[object, object], Awaitable[None]]

    @property
    def requests(self) -> int:
        return count(self.name, self.spec)

    def run(self, runner) -> Awaitable[None]:
        return self.generator(runner, self.spec)


def workloads(args: argparse.Namespace) -> list[Workload]:
    out = [Workload("multiround", MultiRoundSpec(users=args.users, rounds=args.rounds), multiround)]
    qa = QASpec(docs=3, questions=4)
    try:
        find_workload_file("loogle_longdep_qa.jsonl", qa.path)
        out.append(Workload("qa", qa, longdoc_qa))
    except ConfigError as exc:
        print(f"skipping the long-document QA workload: {exc}", file=sys.stderr)
    return out


def measure(workload: Workload, policies: list[SnapshotPolicy], tokenizer) -> dict:
    limit = run(probed_spec(smollm2_360m()), None, workload, tokenizer, f"{workload.name} smollm2-360m")
    print(f"{workload.name}: attention-only limit (SmolLM2-360M shape): hit ratio {limit['hit_ratio']:.3f}, "
          f"{limit['bytes_per_cached_token']:.0f} B per cached token", flush=True)
    figures: dict = {"attention_only": {k: round(v, 4) for k, v in limit.items()}}
    for name, config in MODELS.items():
        spec = probed_spec(config())
        figures[name] = {"snapshot_bytes": spec.snapshot_bytes}
        for policy in policies:
            r = run(spec, policy, workload, tokenizer, f"{workload.name} {name} {policy}")
            r["hit_ratio_vs_limit"] = r["hit_ratio"] / limit["hit_ratio"]
            r["bytes_vs_attention_only"] = r["bytes_per_cached_token"] / limit["bytes_per_cached_token"]
            figures[name][str(policy)] = {k: round(v, 4) for k, v in r.items()}
            print(f"{workload.name}: {name:>18} {str(policy):>12}: hit ratio {r['hit_ratio']:.3f} "
                  f"({r['hit_ratio_vs_limit']:.2f} of the limit), {r['snapshots']:>3} snapshots, "
                  f"{r['bytes_per_cached_token']:>7.0f} B per cached token "
                  f"({r['bytes_vs_attention_only']:.2f}x attention-only)", flush=True)
    return figures


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w for w in figures if isinstance(figures[w], dict) and "attention_only" in figures[w]]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], names):
        limit = figures[workload]["attention_only"]
        ax.scatter([limit["bytes_per_cached_token"] / 1024], [limit["hit_ratio"]], marker="*", s=150, color="k",
                   label="attention-only (SmolLM2-360M shape)")
        for i, model in enumerate(MODELS):
            points = {p: v for p, v in figures[workload][model].items() if isinstance(v, dict)}
            xs = [v["bytes_per_cached_token"] / 1024 for v in points.values()]
            ys = [v["hit_ratio"] for v in points.values()]
            ax.scatter(xs, ys, color=f"C{i}", label=model)
            for policy, x, y in zip(points, xs, ys):
                ax.annotate(policy, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(xlabel="KiB stored per cached token", ylabel="hit ratio (cached / prompt tokens)",
               title=f"snapshot policies: {workload}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=4, help="multi-round: conversations")
    parser.add_argument("--rounds", type=int, default=8, help="multi-round: turns per conversation")
    parser.add_argument("--policies", default="every,every-2,every-4,last,last+every-4")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from kvtier.integrations.models import ensure_smollm2

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    policies = [SnapshotPolicy.parse(p) for p in args.policies.split(",")]
    figures: dict = {"chunk_size": CHUNK, "multiround": f"users={args.users} rounds={args.rounds}"}
    for workload in workloads(args):
        figures[workload.name] = measure(workload, policies, tokenizer)
    out = Path("results/hybrid_snapshots.png")
    plot(figures, out)
    figures["plot"] = str(out)
    result(figures)


if __name__ == "__main__":
    main()
