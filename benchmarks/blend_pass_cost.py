"""What one forward pass costs beyond its tokens, in tokens: the figure ``BlendConfig.pass_tokens`` stands for.

Blending bounds the work one request causes by counting each pass as ``pass_tokens`` plus its tokens (issue 29,
B-1: many tiny segments computed alone, a pass each). This measures that fixed cost on this machine, on one
thread (as the fleet benchmarks' replicas run), for the models the project serves on CPU: the hostile fleet
benchmark's tiny Llama (2 layers), the blending tests' decoder (4 layers) and SmolLM2-135M (30 layers). For
each: the time of a pass over 1 token, and the time per token of passes over 256 and 512 tokens (their
difference, so the fixed part cancels); the cost of a pass in tokens is then ``t(1) / per-token - 1``. Each time
is the fastest of several repetitions.

    PYTHONPATH=. python benchmarks/blend_pass_cost.py [--quick]

Last line: RESULT {json} with each model's pass cost in tokens.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _util import best, result  # noqa: E402


@torch.inference_mode()
def pass_s(model, n: int, reps: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, n))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - start)
    return best(times)


def models() -> dict:
    from transformers import AutoModelForCausalLM

    from kvtier.integrations.models import load_model
    from harness.serve import build_tiny_model
    from harness.blend_models import tiny_decoder

    folder = build_tiny_model(Path(tempfile.mkdtemp(prefix="pass-cost-")))
    return {"fleet_tiny_llama": AutoModelForCausalLM.from_pretrained(folder).eval(),
            "blend_test_decoder": tiny_decoder(),
            "smollm2_135m": load_model()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    reps = 5 if args.quick else 20
    torch.set_num_threads(1)
    figures = {}
    for name, model in models().items():
        one, short, long = (pass_s(model, n, reps) for n in (1, 256, 512))
        per_token = (long - short) / 256
        figures[name] = round(one / per_token - 1, 1)
        print(f"{name:20} pass of 1 token {one * 1e3:7.2f} ms, per token {per_token * 1e6:7.1f} us "
              f"(512 tokens {long * 1e3:7.1f} ms): a pass costs {figures[name]:.1f} tokens")
    result(figures)


if __name__ == "__main__":
    main()
