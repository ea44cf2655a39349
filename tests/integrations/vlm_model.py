"""Idefics3 models (the SmolVLM shape: SigLIP vision tower, pixel-shuffle connector, Llama text model) saved as HF
model folders that vLLM's CPU build serves offline, images included.

* ``TINY``: random weights throughout, a few MB; the tests' model.
* ``SMOLVLM``: SmolVLM-256M's vision tower (random weights) over SmolLM2-135M-Instruct's real text model; the
  benchmark's model, so an image costs what it costs in SmolVLM-256M (without its image splitting).

The tokenizer is SmolLM2's (``kvtier.integrations.models.ensure_smollm2``) with Idefics3's image tokens added; the
image processor is Idefics3's PIL one (no torchvision; vLLM's LLaVA, Qwen2-VL and Gemma-3 modules import it).
Every image becomes ``shape.image_tokens`` placeholder tokens, the same ids for every image: only vLLM's
multimodal hash tells two images apart.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from pathlib import Path

# ChatML as SmolLM2 writes it; vLLM renders the message content as a string with "<image>" where an image goes
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]


@dataclass(frozen=True)
class Shape:
    image_size: int
    patch: int
    scale: int  #: the connector's pixel shuffle: scale**2 patches per placeholder token
    vision: tuple[int, int, int, int]  #: hidden size, MLP size, layers, heads
    smollm2_text: bool  #: SmolLM2-135M-Instruct's text model and weights, else a tiny random Llama

    @property
    def image_seq_len(self) -> int:
        return (self.image_size // self.patch) ** 2 // self.scale**2

    @property
    def image_tokens(self) -> int:
        return self.image_seq_len + 3  # <fake_token_around_image><global-img><image>...<fake_token_around_image>


TINY = Shape(128, 8, 2, (64, 128, 2, 4), smollm2_text=False)
SMOLVLM = Shape(512, 16, 4, (768, 3072, 12, 12), smollm2_text=True)


def build_tiny_vlm(path: Path, *, seed: int = 0) -> Path:
    return build_vlm(path, TINY, seed=seed)


def build_vlm(path: Path, shape: Shape, *, seed: int = 0) -> Path:
    """Write the model, tokenizer and processor to ``path`` (an existing model folder is kept as it is)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import (AutoTokenizer, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor)

    from kvtier.integrations.models import ensure_smollm2

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    side = {"longest_edge": shape.image_size}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side)
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=shape.image_seq_len,
                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(_config(shape, tokenizer, processor.image_token_id))
    with torch.no_grad():
        if shape.smollm2_text:
            _load_smollm2_text(model, ensure_smollm2())
        else:  # larger weights than the default init make greedy choices far apart (stable)
            for p in model.parameters():
                p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path, safe_serialization=True)
    return path


def _config(shape: Shape, tokenizer, image_token_id: int):
    from transformers import AutoConfig, Idefics3Config, Idefics3VisionConfig, LlamaConfig

    from kvtier.integrations.models import ensure_smollm2

    hidden, mlp, layers, heads = shape.vision
    vision = Idefics3VisionConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                                  num_attention_heads=heads, image_size=shape.image_size, patch_size=shape.patch)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad}
    if shape.smollm2_text:
        text = AutoConfig.from_pretrained(ensure_smollm2())
        text.vocab_size, text.tie_word_embeddings = len(tokenizer), False
        for key, value in ids.items():
            setattr(text, key, value)
    else:
        text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                           tie_word_embeddings=False, **ids)
    return Idefics3Config(vision_config=vision, text_config=text, scale_factor=shape.scale,
                          image_token_id=image_token_id, pad_token_id=pad, tie_word_embeddings=False,
                          torch_dtype="float32")


def _load_smollm2_text(model, folder: Path) -> None:
    """SmolLM2's weights into the text model and LM head (the added image tokens keep random rows)."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(folder)
    weights = {k.removeprefix("model."): v for k, v in source.state_dict().items() if k.startswith("model.")}
    embed, head = weights.pop("embed_tokens.weight"), source.get_output_embeddings().weight
    text = model.model.text_model
    text.embed_tokens.weight[: len(embed)] = embed
    model.lm_head.weight[: len(head)] = head
    missing, unexpected = text.load_state_dict(weights, strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)


def image_url(seed: int, size: int = TINY.image_size) -> str:
    """A ``data:`` URL of a random ``size`` x ``size`` RGB PNG, different for each ``seed``."""
    from PIL import Image

    noise = random.Random(seed).randbytes(size * size * 3)
    buf = io.BytesIO()
    Image.frombytes("RGB", (size, size), noise).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
