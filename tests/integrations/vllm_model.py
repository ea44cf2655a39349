"""A tiny Llama with random weights and a locally built word-level tokenizer, saved as a HF model dir."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512


def build_tiny_llama(path: Path, *, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init make greedy choices far apart (stable)
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def prompt_ids(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def run_engine_spec(workdir: Path, name: str, spec: dict, *, in_process: bool, timeout: float = 900) -> tuple:
    """Run ``tests/integrations/vllm_engine.py`` on ``spec`` in its own interpreter (the engine in that process
    with ``in_process``, else in vLLM's worker processes); returns ``(completed process, output path)``. An engine
    still running after ``timeout`` seconds is killed (``subprocess.TimeoutExpired``)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(root), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    proc = subprocess.run([sys.executable, str(root / "tests/integrations/vllm_engine.py"), str(spec_path),
                           str(out_path)], env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout)
    return proc, out_path
