"""A tiny random-weights Llama with a locally trained BPE tokenizer and chat template, and ``kvtier serve`` over it
on a real uvicorn in this process on a free port: the model the serve, route and bench tests and the fleet
benchmarks start servers with where no real weights are needed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvtier.net.ports import free_port

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ("the cache keeps a prefix of every prompt so the server answers faster when users come back with "
         "longer histories and shared documents about cities rivers music history science and weather").split()


def build_tiny_model(folder: Path) -> Path:
    """Save a 2-layer Llama (random weights, seeded) and a BPE tokenizer with a chat template to ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id, tie_word_embeddings=False,
                         initializer_range=0.5)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


class LiveServer:
    """uvicorn serving a Backend in a background thread; ``url`` is its base URL."""

    def __init__(self, backend) -> None:
        import uvicorn

        from kvtier.apps.serve.app import create_app, server_config

        self.backend = backend
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = server_config(create_app(backend), backend, "127.0.0.1", self.port, "warning")  # as kvtier serve
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.backend.close()


def start_server(model_dir: Path, *, cache: bool = True, max_queue: int = 16, chunk_size: int = 16) -> LiveServer:
    from kvtier.apps.serve.backend import Backend, ServerConfig
    from kvtier.core.config import CacheConfig
    from kvtier.tiers import MemoryTierConfig

    cache_config = CacheConfig(chunk_size=chunk_size, tiers=(MemoryTierConfig(capacity_bytes=32 << 20),))
    config = ServerConfig(model_path=model_dir, served_name="tiny", cache=cache_config if cache else None,
                          max_queue=max_queue, default_max_tokens=16)
    return LiveServer(Backend.from_config(config))
