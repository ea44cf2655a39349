"""``kvtier route --prefill URL ... --decode URL ...``: prefill/decode disaggregation behind one OpenAI endpoint.

Each generation request runs in two legs, with vLLM's ``kv_transfer_params`` protocol (the kvtier connector's
side of it: kvtier.integrations.vllm.pd):

1. **Prefill**: the request, with ``max_tokens: 1``, no stream and ``kv_transfer_params: {"do_remote_decode":
   true}`` (beside any params the client sent), goes to a prefill replica chosen as ``kvtier route`` chooses
   any replica: by the prefix it holds and its load, with retries on another prefill replica for a failure
   before it answered. Its answer is read whole (one token); anything but a 200 carrying
   ``kv_transfer_params`` is the client's answer (a 4xx for a bad request is the prefill's to give; a 200
   without params is a 502: the replica does not run a P/D connector).
2. **Decode**: the client's request, untouched but for the returned ``kv_transfer_params``, goes to a decode
   replica chosen by load alone (its prompt is loaded, not computed), retried on another decode replica for a
   failure before the first byte reached the client; its answer, streamed or not, is relayed as it arrives.

A decode replica that dies after committing ends the answer the way ``kvtier route`` ends any broken answer;
one that dies before is retried, and with no decode replica left the client gets a 502 (or a 503 when none is
up). Each leg takes its own admission slot. ``/metrics`` and ``/health`` list both pools' replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from starlette.responses import JSONResponse, Response

from kvtier.api.errors import error_body
from kvtier.apps.route.config import ReplicaEntry, RouterConfig
from kvtier.apps.route.metrics import QUEUE_WAITING
from kvtier.apps.route.requests import ParsedRequest, Prompt
from kvtier.apps.route.service import Router, Tokenizer
from kvtier.base.errors import ConfigError
from kvtier.base.metrics import Metrics

#: what a prefill leg's answer may hold (one token and its usage, and the params): more is not a prefill's answer
MAX_PREFILL_ANSWER = 1 << 20


class PrefillFailed(Exception):
    """The prefill leg ended without params for the decode leg; ``response`` is the client's answer."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def prefill_body(value: dict[str, Any]) -> bytes:
    """The prefill leg's body: the client's request computing one token, asking for a remote decode."""
    body = {k: v for k, v in value.items() if k not in ("stream", "stream_options", "max_completion_tokens",
                                                        "min_tokens")}
    params = value.get("kv_transfer_params")
    body["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), "do_remote_decode": True}
    body["max_tokens"] = 1
    return json.dumps(body).encode()


def decode_body(value: dict[str, Any], returned: dict[str, Any]) -> bytes:
    """The decode leg's body: the client's request with the params the prefill returned (over the client's)."""
    params = value.get("kv_transfer_params")
    return json.dumps({**value, "kv_transfer_params": {**(params if isinstance(params, dict) else {}),
                                                       **returned}}).encode()


async def read_answer(response: Response, limit: int = MAX_PREFILL_ANSWER) -> bytes | None:
    """The whole body of a relayed answer (its stream consumed, so the leg's accounting ends); None past
    ``limit`` bytes."""
    body = bytearray()
    iterator = getattr(response, "body_iterator", None)
    if iterator is None:
        return bytes(response.body)
    async for chunk in iterator:
        body += chunk if isinstance(chunk, bytes) else chunk.encode()
        if len(body) > limit:
            await iterator.aclose()
            return None
    return bytes(body)


def _bad_gateway(message: str) -> Response:
    return JSONResponse(error_body(message, 502), status_code=502)


class PDRouter:
    """Two :class:`Router` pools, prefill and decode, behind one app (``create_app`` takes either kind)."""

    def __init__(self, config: RouterConfig, decode: tuple[str | ReplicaEntry, ...], tokenizer: Tokenizer,
                 metrics: Metrics | None = None) -> None:
        self.config = config  #: the prefill pool's; the decode pool shares everything but the replicas
        self.metrics = metrics if metrics is not None else Metrics()
        self.prefill = Router(config, tokenizer, self.metrics)
        self.decode = Router(dataclasses.replace(config, replicas=decode), tokenizer, self.metrics, gauges=False)
        names = {r.name for r in self.prefill.replicas} & {r.name for r in self.decode.replicas}
        if names:
            raise ConfigError(f"a replica is both a prefill and a decode replica: {', '.join(sorted(names))}")
        self.replicas = [*self.prefill.replicas, *self.decode.replicas]
        self.metrics.add_gauges(self._decode_gauges)

    def _decode_gauges(self):
        return (g for g in self.decode.replica_gauges() if g[0] != QUEUE_WAITING.name)

    async def start(self) -> None:
        await self.prefill.start()
        await self.decode.start()

    async def close(self) -> None:
        await self.prefill.close()
        await self.decode.close()

    async def route(self, path: str, parsed: ParsedRequest, body: bytes,
                    headers: list[tuple[bytes, bytes]]) -> Response:
        """Both legs of one parsed generation request (module docstring)."""
        value = await asyncio.to_thread(json.loads, body)  # parse_request decoded it already: a JSON object
        try:
            params = await self._prefill(path, parsed, value, headers)
        except PrefillFailed as exc:
            return exc.response
        by_load = dataclasses.replace(parsed, prompt=Prompt())  # the decode replica loads the prompt
        return await self.decode.route(path, by_load, decode_body(value, params), headers)

    async def _prefill(self, path: str, parsed: ParsedRequest, value: dict[str, Any],
                       headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        """The params the prefill leg returned; PrefillFailed with the client's answer otherwise."""
        response = await self.prefill.route(path, dataclasses.replace(parsed, stream=False), prefill_body(value),
                                            headers)
        answer = await read_answer(response)
        if response.status_code != 200:
            kept = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
            raise PrefillFailed(Response(answer or b"", response.status_code, headers=kept))
        try:
            params = json.loads(answer or b"").get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise PrefillFailed(_bad_gateway("the prefill replica returned no kv_transfer_params for a decode "
                                             "replica: does it run a P/D connector (KVTierConnector)?"))
        return params
