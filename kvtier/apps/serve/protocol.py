"""OpenAI request bodies: parsing, validation and the subset of the API the server implements.

Decoding is greedy unless a request asks for sampling: ``temperature`` (0 to 2; 0 or absent is greedy),
``top_p``, ``top_k`` (vLLM's extension; -1 or 0 means no limit), ``seed`` and the presence and frequency
penalties become the request's SamplingParams. ``n`` must be 1: one answer per request. Out-of-range values
are refused with a 400 that says why, rather than silently clamped. Unknown fields are refused too, so a typo
never passes unnoticed. The server serves text only: content parts other than text (images, audio, video,
files) and prompt embeddings are refused by name with a 400 (``refuse_non_text``). kvtier's own field,
``cache_ttl_s`` (seconds, from 0 to ``MAX_TTL_S``: what every tier can hold), gives the prompt's cached KV a
retention time (``KVCache.store(ttl_s=)``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvtier.api.chat import ChatMessage, template_messages
from kvtier.api.errors import RequestError
from kvtier.integrations.sampling import SEED_MAX, SEED_MIN, SamplingParams
from kvtier.tiers.control import MAX_TTL_S


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    #: kvtier's extension: the stored prompt KV expires this many seconds later (a miss from then on)
    cache_ttl_s: Annotated[float, Field(ge=0, le=MAX_TTL_S, allow_inf_nan=False)] | None = None

    def check_sampling(self) -> None:
        """Refuse what no sampling setting can serve: more than one answer per request."""
        if self.n not in (None, 1):
            raise RequestError("n must be 1: one completion per request (send several requests instead)",
                               param="n")

    def sampling(self) -> SamplingParams:
        """The request's sampling settings; absent ones are greedy decoding's."""
        return SamplingParams(
            temperature=self.temperature or 0.0, top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else None, seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0)

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stop

    def stop_strings(self) -> list[str]:
        """The stop strings, already checked by ``parse`` (at most 4, none empty)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """``/v1/completions``: ``prompt`` is text or token ids (a batch of one is accepted too)."""

    prompt: str | list[int] | list[str] | list[list[int]]

    def prompt_value(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError("batched prompts are not supported: send one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        return prompt


class ChatRequest(_Common):
    """``/v1/chat/completions``: the model's chat template turns ``messages`` into the prompt."""

    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    @field_validator("messages", mode="plain")
    @classmethod
    def _messages(cls, messages: Any) -> list[ChatMessage]:
        """Checked by msgspec, strictly: at least one message, no field beyond OpenAI's."""
        try:
            checked = msgspec.convert(messages, list[ChatMessage])
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc).replace("`$", "`messages")) from None
        if not checked:
            raise ValueError("at least one message is required")
        return checked

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages)


#: request fields that carry prompt embeddings (vLLM's ``/v1/completions`` extension)
EMBEDDING_FIELDS = ("prompt_embeds",)


def refuse_non_text(body: dict[str, Any]) -> None:
    """RequestError (400) for any input but text: a content part whose ``type`` is not ``"text"`` (``image_url``,
    ``input_audio``, ``video_url``, ``file`` ...) or prompt embeddings. The server's model reads text, and its
    cache keys are token ids only: such an input can be neither served nor cached correctly, so it is refused
    by name rather than as an unknown field."""
    for name in EMBEDDING_FIELDS:
        if name in body:
            raise RequestError(f"kvtier serve serves text only: {name} (prompt embeddings) is not supported; "
                               "send the prompt as text or token ids", param=name)
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise RequestError(f"kvtier serve serves text only: messages[{i}].content[{j}] is a {kind[:64]!r} "
                                   "part; send text parts only", param="messages")


def parse(model: type[_Common], body: Any) -> Any:
    """Validate a decoded JSON body; raise RequestError (400) with every problem spelled out.

    Types are strict, as in OpenAI's API: ``"max_tokens": "3"``, ``"prompt": [1.0, 2.0]`` or ``[true]`` are
    refused rather than coerced to integers.
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    refuse_non_text(body)
    try:
        request = model.model_validate(body, strict=True)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "body"
            msg = "unsupported field" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{where}: {msg}")
        first = exc.errors()[0]["loc"]
        raise RequestError("invalid request: " + "; ".join(problems[:5]),
                           param=str(first[0]) if first else None) from None
    request.check_sampling()
    return request
