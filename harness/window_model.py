"""A random-weight Gemma-3-shaped text model (sliding-window and full-attention layers, 5:1; tiny for the tests,
``SMALL`` for benchmarks) saved as an HF model folder that vLLM's CPU build serves offline, with a word-level
tokenizer (``w3 w4 ...`` is three tokens).

vLLM's hybrid KV cache manager puts its sliding-window layers and its full-attention layers in separate KV cache
groups, so a prompt longer than ``window`` exercises both kinds of group. Weights are drawn once from a seed
(untied embeddings: tied ones make one token win nearly every greedy step).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = 512
#: the tests' model: hidden size 128, 6 layers, 4 query and 2 KV heads of 32 dims, 512 words
TINY = {"hidden": 128, "intermediate": 256, "layers": 6, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": VOCAB}
#: a Gemma-3 shape near SmolLM2-135M's size (about 140M parameters): hidden size 576, 24 layers, 9 query and 3 KV
#: heads of 64 dims, 49,152 words; what a prefill costs then outweighs vLLM's per-step overhead
SMALL = {"hidden": 576, "intermediate": 1536, "layers": 24, "heads": 9, "kv_heads": 3, "head_dim": 64, "vocab": 49152}


def word(i: int, vocab: int = VOCAB) -> str:
    """Token ``i``'s word: ``w`` and ``i`` in decimal, or above 512 words in base 36 (``w11xb``), so that a prompt
    stays under the 6 characters a token vLLM's server allows before tokenizing it."""
    if vocab <= VOCAB:
        return f"w{i}"
    digits = ""
    while i:
        i, d = divmod(i, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[d] + digits
    return "w" + digits


def write_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """The word-level tokenizer (``<pad>``, ``<bos>``, ``<eos>``, then ``word(3)`` .. ``word(vocab - 1)``) saved
    into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{word(i, vocab): i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")
    fast.save_pretrained(path)


def build_tiny_gemma3(path: Path, *, window: int = 96, layers: int | None = None, seed: int = 0,
                      shape: dict = TINY) -> Path:
    """A Gemma3ForCausalLM of ``shape`` (TINY or SMALL; ``layers`` overrides its layer count): every 6th layer full
    attention, the rest attending ``window`` tokens back, float32. Returns ``path``."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path.mkdir(parents=True, exist_ok=True)
    layers = layers or shape["layers"]
    write_tokenizer(path, shape["vocab"])
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = Gemma3TextConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                              intermediate_size=shape["intermediate"], num_hidden_layers=layers,
                              num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                              head_dim=shape["head_dim"], sliding_window=window, layer_types=types,
                              max_position_embeddings=4096, query_pre_attn_scalar=shape["head_dim"],
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
