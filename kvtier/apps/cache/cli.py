"""``kvtier cache``: look up, pin, unpin, clear and inspect the cache of a running ``kvtier serve``, a whole
fleet behind ``kvtier route`` (which fans each call out to its replicas) or one rank of vLLM's kvtier connector
(its ``metrics_port``), through their admin API (/admin/v1).

    export KVTIER_ADMIN_KEY=...                              # or --key-file: the admin key, or a tenant's key
    kvtier cache lookup --url http://127.0.0.1:8000 --text "You are a helpful assistant."
    kvtier cache lookup --url http://router:9000 --tokens 1,2,3,4 --tenant acme
    kvtier cache pin    --url http://127.0.0.1:8000 --file system_prompt.txt --tier memory --tier disk
    kvtier cache unpin  --url http://127.0.0.1:8000 --file system_prompt.txt
    kvtier cache clear  --url http://127.0.0.1:8000 --tenant acme    # or --model, --all; a tenant key: its own
    kvtier cache stats  --url http://127.0.0.1:8000

Prints the server's JSON answer; exits 0 when it is a success, 1 with the server's error otherwise (2 for a
usage error). With a tenant key only ``lookup`` and ``clear`` of the tenant's own entries are allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvtier.api.admin import ADMIN_KEY_ENV


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("cache", help="look up, pin, clear and inspect a running server's cache",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ops = p.add_subparsers(dest="op", metavar="OP", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", required=True, help="a kvtier serve or kvtier route, e.g. http://127.0.0.1:8000")
    common.add_argument("--key-file", help=f"file whose first line is the key to send (default: ${ADMIN_KEY_ENV})")
    common.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the answer")
    prompt = argparse.ArgumentParser(add_help=False)
    which = prompt.add_mutually_exclusive_group(required=True)
    which.add_argument("--text", help="the prompt as text (tokenized by the server's tokenizer)")
    which.add_argument("--tokens", help="the prompt as comma-separated token ids")
    which.add_argument("--file", help="a file holding the prompt's text")
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
    if args.tokens is not None:
        try:
            body = {"tokens": [int(t) for t in args.tokens.split(",") if t.strip()]}
        except ValueError:
            raise ValueError(f"--tokens takes comma-separated integers, not {args.tokens!r}") from None
    else:
        body = {"text": args.text if args.text is not None else Path(args.file).read_text(encoding="utf-8")}
    if args.tenant:
        body["tenant"] = args.tenant
    if getattr(args, "tiers", None):
        body["tiers"] = args.tiers
    return "POST", f"/admin/v1/{args.op}", body


def key_of(args: argparse.Namespace) -> str | None:
    if args.key_file:
        return Path(args.key_file).read_text(encoding="utf-8").splitlines()[0].strip() or None
    return os.environ.get(ADMIN_KEY_ENV) or None


def run(args: argparse.Namespace) -> int:
    import httpx

    try:
        method, path, body = request_of(args)
        key = key_of(args)
    except (OSError, ValueError, IndexError) as exc:
        print(f"kvtier cache: {exc}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        answer = httpx.request(method, args.url.rstrip("/") + path, json=body, headers=headers,
                               timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"kvtier cache: {args.url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    try:
        parsed = answer.json()
    except ValueError:
        parsed = answer.text
    print(json.dumps(parsed, indent=1) if not isinstance(parsed, str) else parsed)
    if answer.is_success:
        return 0
    message = parsed.get("error", {}).get("message") if isinstance(parsed, dict) else None
    print(f"kvtier cache: {answer.status_code}: {message or 'the server refused'}", file=sys.stderr)
    return 1
