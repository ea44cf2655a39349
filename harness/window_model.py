"""A tiny random-weight Gemma-3-shaped text model (sliding-window and full-attention layers, 5:1) saved as an HF
model folder that vLLM's CPU build serves offline, with a word-level tokenizer (``w3 w4 ...`` is three tokens).

vLLM's hybrid KV cache manager puts its sliding-window layers and its full-attention layers in separate KV cache
groups, so a prompt longer than ``window`` exercises both kinds of group. Weights are drawn once from a seed
(untied embeddings: tied ones make one token win nearly every greedy step).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = 512


def write_tokenizer(path: Path) -> None:
    """The word-level tokenizer (``<pad>``, ``<bos>``, ``<eos>``, then ``w3`` .. ``w511``) saved into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")
    fast.save_pretrained(path)


def build_tiny_gemma3(path: Path, *, window: int = 96, layers: int = 6, seed: int = 0) -> Path:
    """A Gemma3ForCausalLM of ``layers`` layers (every 6th full attention, the rest attending ``window`` tokens
    back), hidden size 128, 4 query and 2 KV heads of 32 dims, float32. Returns ``path``."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path)
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=window,
                              layer_types=types, max_position_embeddings=4096, query_pre_attn_scalar=32,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                              torch_dtype="float32")
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def words(seed: int, n: int) -> str:
    """``n`` random words of the vocabulary (``n`` tokens), the same for the same seed."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(n))
