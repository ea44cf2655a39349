"""``kvtier cache``: look up, pin, unpin, clear and inspect the cache of a running ``kvtier serve``, a whole
fleet behind ``kvtier route`` (which fans each call out to its replicas) or one rank of vLLM's kvtier connector
(its ``metrics_port``), through their admin API (/admin/v1).

    export KVTIER_ADMIN_KEY=...                              # or --key-file: the admin key, or a tenant's key
    kvtier cache lookup --url http://127.0.0.1:8000 --text "You are a helpful assistant."
    kvtier cache lookup --url http://127.0.0.1:8000 --chat messages.json     # an OpenAI messages list
    kvtier cache lookup --url http://router:9000 --tokens 1,2,3,4 --tenant acme
    kvtier cache pin    --url http://127.0.0.1:8000 --chat system.json --tier memory --tier disk
    kvtier cache unpin  --url http://127.0.0.1:8000 --chat system.json
    kvtier cache clear  --url http://127.0.0.1:8000 --tenant acme    # or --model, --all; a tenant key: its own
    kvtier cache stats  --url http://127.0.0.1:8000
    kvtier cache --url http://127.0.0.1:8000 stats                   # --url, --key-file, --timeout: either side

``--chat`` prompts are rendered by the server's own chat template, as its chat route renders them: the prefix
that the chat's next requests share (with the assistant's cue when the last message is the user's; override
with --generation-prompt / --no-generation-prompt). ``--text`` and ``--file`` are completion prompts.

Prints the server's JSON answer and exits 0 on success; 3 when a lookup or pin matched nothing (no cached
token: said on stderr); 1 with one line on stderr for an error answer, an answer that is not JSON, or none
within --timeout (one deadline for the whole call); 2 for a usage error. With a tenant key only ``lookup`` and
``clear`` of the tenant's own entries are allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvtier.api.admin import ADMIN_KEY_ENV
from kvtier.apps.cache.answers import error_message, matched

NOTHING_MATCHED = 3  #: the exit code of a lookup or pin that found no cached token


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("cache", help="look up, pin, clear and inspect a running server's cache",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _client_options(p, None)
    ops = p.add_subparsers(dest="op", metavar="OP", required=True)
    common = argparse.ArgumentParser(add_help=False)
    _client_options(common, argparse.SUPPRESS)  # given after the op they win; absent they leave the cache's
    prompt = argparse.ArgumentParser(add_help=False)
    which = prompt.add_mutually_exclusive_group(required=True)
    which.add_argument("--text", help="the prompt as text (tokenized by the server's tokenizer)")
    which.add_argument("--tokens", help="the prompt as comma-separated token ids")
    which.add_argument("--file", help="a file holding the prompt's text")
    which.add_argument("--chat", metavar="JSON_FILE",
                       help="a file holding an OpenAI messages list (or a chat request with 'messages'), rendered "
                            "by the server's chat template")
    prompt.add_argument("--generation-prompt", action=argparse.BooleanOptionalAction, default=None,
                        help="with --chat: end with the assistant's cue, or not (default: when the last message "
                             "is the user's)")
    prompt.add_argument("--tenant", help="admin only: a tenant name of the server's config, or 'default'")
    ops.add_parser("lookup", parents=[common, prompt], help="cached prefix tokens of a prompt, in all and per tier")
    for op in ("pin", "unpin"):
        sub = ops.add_parser(op, parents=[common, prompt], help=f"{op} a prompt's cached prefix (admin key)")
        sub.add_argument("--tier", action="append", dest="tiers", help="only this tier (repeat for several)")
    clear = ops.add_parser("clear", parents=[common], help="remove entries from every tier")
    scope = clear.add_mutually_exclusive_group()
    scope.add_argument("--tenant", help="this tenant's entries (admin; a tenant key clears its own without it)")
    scope.add_argument("--model", action="store_true", help="the served model's entries (admin)")
    scope.add_argument("--all", action="store_true", help="everything every tier holds (admin)")
    ops.add_parser("stats", parents=[common], help="entries, bytes, pins, tenants and admission per tier (admin)")
    p.set_defaults(func=run)
    return p


def _client_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """--url, --key-file and --timeout; ``default`` SUPPRESS on the ops' copies, so that an option given before
    the op is not overwritten by the op's default."""
    parser.add_argument("--url", default=default,
                        help="a kvtier serve, kvtier route or vLLM rank, e.g. http://127.0.0.1:8000 (required)")
    parser.add_argument("--key-file", default=default,
                        help=f"file whose first line is the key to send (default: ${ADMIN_KEY_ENV})")
    parser.add_argument("--timeout", type=float, default=default if default is not None else 120.0,
                        help="seconds the whole call may take, answer included (default: 120)")


def request_of(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, JSON body) of the call the arguments describe; ValueError for a bad argument."""
    if args.op == "stats":
        return "GET", "/admin/v1/stats", None
    if args.op == "clear":
        scope = "all" if args.all else "model" if args.model else "tenant"
        body: dict[str, Any] = {"scope": scope}
        if args.tenant:
            body["tenant"] = args.tenant
        return "POST", "/admin/v1/clear", body
    body = _prompt_body(args)
    if args.tenant:
        body["tenant"] = args.tenant
    if getattr(args, "tiers", None):
        body["tiers"] = args.tiers
    return "POST", f"/admin/v1/{args.op}", body


def _prompt_body(args: argparse.Namespace) -> dict[str, Any]:
    if args.generation_prompt is not None and args.chat is None:
        raise ValueError("--generation-prompt / --no-generation-prompt go with --chat")
    if args.tokens is not None:
        try:
            return {"tokens": [int(t) for t in args.tokens.split(",") if t.strip()]}
        except ValueError:
            raise ValueError(f"--tokens takes comma-separated integers, not {args.tokens!r}") from None
    if args.chat is not None:
        body: dict[str, Any] = {"messages": chat_messages(Path(args.chat))}
        if args.generation_prompt is not None:
            body["add_generation_prompt"] = args.generation_prompt
        return body
    return {"text": args.text if args.text is not None else Path(args.file).read_text(encoding="utf-8")}


def chat_messages(path: Path) -> list[Any]:
    """The messages list in the JSON file at ``path``: a list, or an object with ``messages`` (a chat request's
    body); the server checks each message. ValueError (one line) for anything else."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if isinstance(value, dict):
        value = value.get("messages")
    if not isinstance(value, list) or not value:
        raise ValueError(f"{path} must hold a non-empty list of chat messages, or an object with 'messages'")
    return value


def key_of(args: argparse.Namespace) -> str | None:
    if args.key_file:
        return Path(args.key_file).read_text(encoding="utf-8").splitlines()[0].strip() or None
    return os.environ.get(ADMIN_KEY_ENV) or None


def run(args: argparse.Namespace) -> int:
    from kvtier.apps.cache.client import CallError, call

    try:
        if not args.url:
            raise ValueError("--url is required (before or after the operation)")
        if not args.timeout > 0:
            raise ValueError("--timeout must be a positive number of seconds")
        method, path, body = request_of(args)
        key = key_of(args)
    except (OSError, ValueError, IndexError, UnicodeDecodeError) as exc:
        print(f"kvtier cache: {exc}", file=sys.stderr)
        return 2
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        answer = call(method, args.url.rstrip("/") + path, body, headers, args.timeout)
    except CallError as exc:
        print(f"kvtier cache: {exc}", file=sys.stderr)
        return 1
    if not answer.ok or "error" in answer.body:  # a 2xx with an error in it is no success either
        print(f"kvtier cache: {answer.status}: {error_message(answer.body)}", file=sys.stderr)
        return 1
    print(json.dumps(answer.body, indent=1))
    if args.op in ("lookup", "pin") and not matched(args.op, answer.body):
        what = "is cached" if args.op == "lookup" else "was pinned"
        print(f"kvtier cache: nothing of this prompt {what} (0 tokens matched)", file=sys.stderr)
        return NOTHING_MATCHED
    return 0
