"""Which tokenizer ``kvtier route`` hashes prompts with: ``--model``, or the model the replicas name.

The router's chunk keys must be the replicas' own, so it needs their tokenizer and chat template. Without
``--model`` it asks the replicas (``GET /v1/models``, the first model each names) and uses that name as a local
folder or an entry of the local Hugging Face cache, offline, or, for the model kvtier ships (SmolLM2-135M-Instruct,
what a default ``kvtier serve`` names), kvtier's own converted copy. Anything else is a ``ConfigError`` whose one line
says what to pass: no replica named a model, the replicas name different ones, or the one they name is not at
hand. It never falls back to another model's tokenizer: a router hashing a Llama fleet's prompts with SmolLM2's
tokenizer would route by keys no replica holds.
"""

from __future__ import annotations

import os

import httpx
import msgspec

from kvtier.base.errors import ConfigError
from kvtier.integrations.models import SMOLLM2_NAME
from kvtier.integrations.prompt_cache import DEFAULT_MAX_ENTRIES

PASS_MODEL = "pass --model DIR (the folder of the replicas' tokenizer and chat template)"


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


def named_model(urls: list[str], timeout_s: float = 5.0) -> str | None:
    """The model the replicas name at ``/v1/models`` (the first each lists), None if none answers with one;
    ConfigError if they name different ones."""
    names = set()
    for url in urls:
        try:
            answer = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s)
            models = msgspec.json.decode(answer.content, type=_Models) if answer.status_code == 200 else None
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        if models is not None and models.data:
            names.add(models.data[0].id)
    if len(names) > 1:
        raise ConfigError(f"the replicas serve different models ({', '.join(sorted(names))}); {PASS_MODEL}")
    return names.pop() if names else None


def tokenizer_for(model: str | None, urls: list[str], cache_entries: int = DEFAULT_MAX_ENTRIES):
    """The PromptTokenizer of ``model`` (``--model``), else of the model the replicas name; ConfigError with one
    line saying what to pass when neither gives one."""
    try:
        from kvtier.integrations.prompts import PromptTokenizer
    except ImportError as exc:
        raise ConfigError(f"the router tokenizes prompts with transformers, which is not installed ({exc.name})")
    if model is not None:
        try:
            return PromptTokenizer(model, cache_entries)
        except ConfigError as exc:
            reason = " ".join(str(exc).split())[:300]
            raise ConfigError(f"--model {model} holds no tokenizer the router can load ({reason})") from None
    named = named_model(urls)
    if named is None:
        raise ConfigError(f"no replica names its model at /v1/models; {PASS_MODEL}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a name is looked up in the local cache, never downloaded
    try:
        return PromptTokenizer(None if named == SMOLLM2_NAME else named, cache_entries)  # None: the packaged one
    except ConfigError:
        raise ConfigError(f"the replicas serve {named!r}, whose tokenizer is not at hand here; {PASS_MODEL}") from None
