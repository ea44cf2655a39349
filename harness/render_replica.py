"""A stand-in vLLM replica for ``vllm-router --policy kv_aware``, run as its own process on a loopback port.

    python -m harness.render_replica PORT MODEL_NAME TOKENIZER_FOLDER

vllm-router does not tokenize: it asks the replica it may pick for the prompt's token ids at vLLM's render
endpoints (``/v1/chat/completions/render``, ``/v1/completions/render``), and routes by what the KV events say the
replicas hold of those ids. This replica answers them as ``vllm serve --enable-scale-out`` does, with the token
ids of the real tokenizer in TOKENIZER_FOLDER (its chat template for a chat), so what the router credits can be
read off its decision log against KV events whose blocks are those very ids, without loading a model. The
generation routes answer a small completion naming the port that served it; ``/health`` and ``/v1/models``
answer as vLLM's do. The KV events themselves are published by whoever drives the test (vLLM's own ZMQ
publisher), not by this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Self

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from harness.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]


def create_app(port: int, model: str, tokenizer_folder: str) -> Starlette:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)

    def ids_of(body: dict) -> list[int]:
        if "messages" in body:
            return list(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
        prompt = body.get("prompt")
        return list(prompt) if isinstance(prompt, list) else tokenizer.encode(str(prompt))

    async def health(request: Request) -> Response:
        return JSONResponse({})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm"}]})

    async def render(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            ids = ids_of(body)
        except (ValueError, TypeError, KeyError) as exc:
            return PlainTextResponse(f"bad request: {exc}", status_code=400)
        # vLLM's GenerateRequest, as its render endpoints answer it
        return JSONResponse({"request_id": str(uuid.uuid4()), "token_ids": ids, "model": model, "stream": False,
                             "sampling_params": {"max_tokens": body.get("max_tokens") or 16,
                                                 "temperature": body.get("temperature", 1.0)}})

    async def generate(request: Request) -> Response:
        body = json.loads(await request.body())
        return JSONResponse({"id": "cmpl-stand-in", "object": "chat.completion", "model": model, "served_by": port,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                          "text": "ok", "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": len(ids_of(body)), "completion_tokens": 1,
                                       "total_tokens": len(ids_of(body)) + 1}})

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/chat/completions/render", render, methods=["POST"]),
                             Route("/v1/completions/render", render, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/completions", generate, methods=["POST"])])


class RenderReplica(ServerProcess):
    """This module as a process on ``port`` (its output in ``log``); ``url`` is what vllm-router's
    ``--worker-urls`` names."""

    def __init__(self, port: int, model: str, tokenizer: str, log: Path) -> None:
        self.port, self.model, self.tokenizer, self.log = port, model, tokenizer, log
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> Self:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "harness.render_replica", str(self.port), self.model,
                                          self.tokenizer], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the stand-in replica exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise RuntimeError(f"the stand-in replica did not answer within {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="a stand-in vLLM replica answering render endpoints (module docstring)")
    p.add_argument("port", type=int)
    p.add_argument("model", help="the served model name")
    p.add_argument("tokenizer", help="a folder with the tokenizer (and chat template) of that model")
    args = p.parse_args()
    uvicorn.run(create_app(args.port, args.model, args.tokenizer), host="127.0.0.1", port=args.port,
                log_level="warning")
