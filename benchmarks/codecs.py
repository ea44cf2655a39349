"""KV codecs on real KV: SmolLM2-135M-Instruct's cache over real LooGLE documents.

For each codec, on the bf16 prefix KV of a few documents cut into 256-token chunks:

* ratio: bf16 bytes / codec payload bytes (the blob header, ~1 KiB per chunk for its token ids, is the
  same for every codec and left out);
* encode / decode throughput in MB/s of uncompressed bf16, best of ``--reps`` on one thread, next to a
  plain ``clone`` of the same chunk (memcpy, the limit) measured in the same run;
* effect on the model: the next ``--cont`` tokens of each document are scored with the prefix KV decoded
  vs exact (bf16): top-1 agreement and mean KL(exact || decoded) of the next-token distributions;
* greedy answers to the documents' questions (chat template, document first so it is the cached prefix)
  with decoded vs exact prefix KV: identical or not.

Also compares the two entropy coders considered for ``cachegen`` on its own symbols: zstd (Huffman) and
rANS from ``constriction`` (when installed). Prints a markdown table, then ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._util import best, result, timed
from kvtier.codecs import get_codec

# The workloads folder: $KVTIER_WORKLOADS, else shared/ beside the repository (CI) or its worktree parent.
_ROOT = Path(__file__).resolve().parents[1]
DOCS = next((p for p in (Path(os.environ.get("KVTIER_WORKLOADS", "/nonexistent")),
                         _ROOT.parent / "shared" / "workloads", _ROOT.parent.parent / "shared" / "workloads")
             if p.is_dir()), _ROOT.parent / "shared" / "workloads")
CODECS = ["raw", "lossless", "lossless-z1", "lossless-lz4", "int8", "int4", "cachegen"]
CHUNK = 256


def load_docs(path: Path, n: int) -> list[dict]:
    if not path.exists():
        sys.exit(f"no workload at {path}: set KVTIER_WORKLOADS to the folder holding loogle_longdep_qa.jsonl")
    with path.open() as fh:
        return [json.loads(line) for line, _ in zip(fh, range(n))]


@torch.inference_mode()
def prefix_kv(model, ids: list[int]) -> torch.Tensor:
    """Canonical bf16 KV of ``ids`` (the model runs in float32; stored KV is bf16)."""
    from kvtier.integrations.transformers import to_canonical

    out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    return to_canonical(out.past_key_values).to(torch.bfloat16)


def codec_roundtrip(codec, kv: torch.Tensor, reps: int, times: dict) -> tuple[torch.Tensor, int]:
    """Decode(encode(kv)) chunk by chunk; adds best-of-reps seconds to ``times``; returns (kv', bytes)."""
    parts, nbytes = [], 0
    for start in range(0, kv.shape[2], CHUNK):
        chunk = kv[:, :, start : start + CHUNK].contiguous()
        payload = codec.encode(chunk)
        buf = bytearray(payload.nbytes)
        payload.write_into(memoryview(buf))
        view = memoryview(buf)

        def encode(chunk: torch.Tensor = chunk) -> None:
            p = codec.encode(chunk)
            p.write_into(memoryview(bytearray(p.nbytes)))

        times["encode"] += best(timed(encode, reps))
        times["decode"] += best(timed(lambda v=view, c=chunk: codec.decode(v, tuple(c.shape), c.dtype), reps))
        times["memcpy"] += best(timed(chunk.clone, reps))
        parts.append(codec.decode(view, tuple(chunk.shape), chunk.dtype).clone())
        nbytes += len(buf)
    return torch.cat(parts, dim=2), nbytes


@torch.inference_mode()
def next_token_logits(model, kv: torch.Tensor, cont: list[int]) -> torch.Tensor:
    from kvtier.integrations.transformers import to_dynamic_cache

    past = to_dynamic_cache(kv.float(), model)
    return model(input_ids=torch.tensor([cont]), past_key_values=past, use_cache=True).logits[0].float()


@torch.inference_mode()
def greedy(model, kv: torch.Tensor, rest: list[int], n: int, stop: int) -> list[int]:
    from kvtier.integrations.transformers import to_dynamic_cache

    past = to_dynamic_cache(kv.float(), model)
    out: list[int] = []
    ids = rest
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token == stop:
            break
        ids = [token]
    return out


def build_cases(tok, docs: list[dict], args) -> list[dict]:
    """Per document: scoring tokens (prefix + continuation) and question prompts sharing a document prefix."""
    cases = []
    for doc in docs:
        ids = tok(doc["input"]).input_ids
        text = tok.decode(ids[: args.doc_tokens])
        prompts = []
        pairs = doc["qa_pairs"]
        if isinstance(pairs, str):  # LooGLE stores them as a Python literal
            pairs = ast.literal_eval(pairs)
        for qa in pairs[: args.questions]:
            messages = [{"role": "user", "content": f"{text}\n\nAnswer briefly. {qa['Q']}"}]
            prompts.append(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in prompts]
        common = min(len(p) for p in prompts) - 1
        for i in range(common):  # the questions share the template and document up to here
            if len({p[i] for p in prompts}) > 1:
                common = i
                break
        cases.append({"score": ids[: args.prefix + args.cont], "prompts": prompts,
                      "qa_prefix": common // CHUNK * CHUNK})
    return cases


def measure(args) -> dict:
    from kvtier.integrations.models import load_model

    model, tok = load_model()
    cases = build_cases(tok, load_docs(DOCS / "loogle_longdep_qa.jsonl", args.docs), args)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    exact = []
    for case in tqdm(cases, desc="exact KV", leave=False):
        kv = prefix_kv(model, case["score"][: args.prefix])
        ref = next_token_logits(model, kv, case["score"][args.prefix :])
        qa_kv = prefix_kv(model, case["prompts"][0][: case["qa_prefix"]])
        answers = [greedy(model, qa_kv, p[case["qa_prefix"] :], args.answer_tokens, stop) for p in case["prompts"]]
        exact.append((kv, ref, qa_kv, answers))
    rows = {}
    for name in tqdm(args.codecs, desc="codecs"):
        codec = get_codec(name)
        times = {"encode": 0.0, "decode": 0.0, "memcpy": 0.0}
        raw_bytes = packed = 0
        agree, kls, same, asked = [], [], 0, 0
        for case, (kv, ref, qa_kv, answers) in zip(cases, exact):
            kv2, nbytes = codec_roundtrip(codec, kv, args.reps, times)
            raw_bytes, packed = raw_bytes + kv.numel() * 2, packed + nbytes
            logits = next_token_logits(model, kv2, case["score"][args.prefix :])
            agree.append((logits.argmax(-1) == ref.argmax(-1)).float())
            lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
            kls.append((lp.exp() * (lp - lq)).sum(-1))
            qa_kv2, _ = codec_roundtrip(codec, qa_kv, 1, {"encode": 0.0, "decode": 0.0, "memcpy": 0.0})
            for prompt, want in zip(case["prompts"], answers):
                same += greedy(model, qa_kv2, prompt[case["qa_prefix"] :], args.answer_tokens, stop) == want
                asked += 1
        rows[name] = {
            "ratio": raw_bytes / packed,
            "encode_mb_s": raw_bytes / times["encode"] / 1e6,
            "decode_mb_s": raw_bytes / times["decode"] / 1e6,
            "memcpy_mb_s": raw_bytes / times["memcpy"] / 1e6,
            "top1_agreement": torch.cat(agree).mean().item(),
            "mean_kl": torch.cat(kls).mean().item(),
            "answers_identical": f"{same}/{asked}",
            "positions": int(torch.cat(agree).numel()),
        }
    rows["_entropy_coders"] = entropy_coders(exact[0][0])
    return rows


def entropy_coders(kv: torch.Tensor) -> dict:
    """zstd-1 (Huffman) vs rANS (constriction, per-slab categorical tables) on cachegen's symbols."""
    import numpy as np
    import zstandard

    _, _, sym = get_codec("cachegen").symbols(kv[:, :, :CHUNK])
    slabs = [s.numpy().reshape(-1) for s in sym.reshape(sym.shape[0] * 2, -1)]
    n = sum(s.size for s in slabs)
    frames = [zstandard.ZstdCompressor(level=1).compress(s) for s in slabs]
    dec = zstandard.ZstdDecompressor()
    t = best(timed(lambda: [dec.decompress(f) for f in frames], 3))
    out = {"zstd_bits_per_symbol": 8 * sum(map(len, frames)) / n, "zstd_decode_msym_s": n / t / 1e6}
    try:
        import constriction
    except ImportError:
        return out
    coded = []
    for s in slabs:
        values = s.view(np.int8).astype(np.int32) + 128
        probs = np.bincount(values, minlength=256).astype(np.float64)
        model = constriction.stream.model.Categorical(probs / probs.sum(), perfect=False)
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(values, model)
        coded.append((coder.get_compressed(), model, values.size))
    t = best(timed(lambda: [constriction.stream.stack.AnsCoder(c).decode(m, k) for c, m, k in coded], 3))
    # the tables (256 probabilities per slab) are left out: the coder's best case
    out["ans_bits_per_symbol"] = 32 * sum(c.size for c, _, _ in coded) / n
    out["ans_decode_msym_s"] = n / t / 1e6
    return out


def table(rows: dict) -> str:
    lines = [("| codec | ratio vs bf16 | encode MB/s | decode MB/s | decode / memcpy | top-1 agreement | mean KL | "
              "greedy answers identical |"), "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if name.startswith("_"):
            continue
        zero_copy = r["decode_mb_s"] > 10 * r["memcpy_mb_s"]  # raw decodes to a view of the payload
        decode = "view" if zero_copy else f"{r['decode_mb_s']:.0f}"
        vs_memcpy = "-" if zero_copy else f"{r['decode_mb_s'] / r['memcpy_mb_s']:.2f}"
        lines.append(f"| {name} | {r['ratio']:.2f} | {r['encode_mb_s']:.0f} | {decode} | {vs_memcpy} | "
                     f"{r['top1_agreement']:.4f} | {r['mean_kl']:.5f} | {r['answers_identical']} |")
    return "\n".join(lines)


def plot(rows: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, r in rows.items():
        if not name.startswith("_"):
            ax.scatter(r["ratio"], r["top1_agreement"])
            ax.annotate(name, (r["ratio"], r["top1_agreement"]), textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel("compression ratio vs bf16")
    ax.set_ylabel("next-token top-1 agreement")
    ax.set_title("KV codecs on SmolLM2-135M, LooGLE documents")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=2, help="documents (of 5)")
    parser.add_argument("--prefix", type=int, default=1024, help="prefix tokens whose KV is compressed")
    parser.add_argument("--cont", type=int, default=256, help="continuation tokens scored per document")
    parser.add_argument("--doc-tokens", type=int, default=1100, help="document tokens in question prompts")
    parser.add_argument("--questions", type=int, default=2, help="questions per document")
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5, help="timing repetitions (best is kept)")
    parser.add_argument("--codecs", nargs="+", default=CODECS)
    parser.add_argument("--plot", help="write a ratio-vs-agreement PNG here")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # codec throughput per core; the model runs on the same single thread
    rows = measure(args)
    print(table(rows))
    coders = {k: round(v, 3) for k, v in rows["_entropy_coders"].items()}
    print("entropy coders on cachegen symbols:", json.dumps(coders))
    if args.plot:
        plot(rows, args.plot)
    figures = {name: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for name, r in rows.items()
               if not name.startswith("_")}
    figures["entropy_coders"] = {k: round(v, 3) for k, v in rows["_entropy_coders"].items()}
    result(figures)


if __name__ == "__main__":
    main()
