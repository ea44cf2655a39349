"""A tiny Idefics3 (the SmolVLM shape: SigLIP vision tower, pixel-shuffle connector, Llama text model) with random
weights, saved as a HF model folder that vLLM's CPU build serves offline, images included.

The text tokenizer is SmolLM2's (``kvtier.integrations.models.ensure_smollm2``) with Idefics3's image tokens added;
the image processor is Idefics3's PIL one (no torchvision; vLLM's LLaVA and Qwen2-VL modules import torchvision).
Each 128x128 image becomes ``IMAGE_TOKENS`` placeholder tokens, the same ids for every image: only vLLM's
multimodal hash tells two images apart.
"""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

IMAGE_SIZE, PATCH, SCALE = 128, 8, 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2 + 3  # <image> x 64 between its wrapping tokens
# ChatML as SmolLM2 writes it; vLLM renders the message content as a string with "<image>" where an image goes
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_vlm(path: Path, *, seed: int = 0) -> Path:
    """Write the model, tokenizer and processor to ``path`` (an existing model folder is kept as it is)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessorPil, Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    from kvtier.integrations.models import ensure_smollm2

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                                "<end_of_utterance>", "<global-img>"]})
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    seq_len = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=seq_len,
                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=IMAGE_SIZE, patch_size=PATCH)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=pad, tie_word_embeddings=False)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=SCALE,
                            image_token_id=processor.image_token_id, pad_token_id=pad,
                            tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():  # larger weights than the default init make greedy choices far apart (stable)
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path, safe_serialization=True)
    return path


def image_url(seed: int) -> str:
    """A ``data:`` URL of a random 64x64 RGB PNG, different for each ``seed``."""
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (IMAGE_SIZE, IMAGE_SIZE), bytes(rng.randrange(256) for _ in range(IMAGE_SIZE ** 2 * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(text: str, seed: int) -> list[dict]:
    """One user message: ``text`` with the image of ``seed`` before it."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(seed)}},
                                         {"type": "text", "text": text}]}]
