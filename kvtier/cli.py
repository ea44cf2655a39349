"""``kvtier <command>``: each command lives in its own module exposing ``add_parser(subparsers)``.

The module's parser sets ``func`` (called with the parsed args; its return value is the exit code).
Commands are imported lazily, so ``kvtier --help`` never imports torch or an engine. Every option's help shows
its default. A missing optional module (an extra not installed) is one line naming the extra, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtier.base.errors import MissingDependency
from kvtier.base.extras import missing_dependency

#: command name -> (module implementing it, its purpose in one line for ``kvtier --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvtier.apps.demo", "serve the packaged SmolLM2 with and without kvtier and compare TTFT"),
    "serve": ("kvtier.apps.serve.cli", "an OpenAI-compatible server over a transformers model, with kvtier's tiers"),
    "bench": ("kvtier.apps.bench.cli", "measure any OpenAI-compatible endpoint on chat, trace or RAG workloads"),
    "route": ("kvtier.apps.route.cli", "a cache- and tier-aware router in front of kvtier serve or vLLM replicas"),
    "sim": ("kvtier.apps.sim.cli", "simulate a fleet's routing and caching, or replay a kvtier bench result"),
    "cache": ("kvtier.apps.cache.cli", "look up, pin, expire, share or clear cached prefixes on a server"),
    "calibrate": ("kvtier.apps.calibrate.cli", "measure which codec loads fastest from which tier on this machine"),
    "vllm": ("kvtier.integrations.vllm.cli", "vLLM's own command line (vllm ARGS), also on vLLM's CPU build"),
}


class _DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written (the commands' module docstrings) and appends ``(default: X)`` to an option's help when it has a default worth showing (not None/False/[])."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not text or "%(default)" in text or default is None or default is False or default == []:
            return text
        if default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Every command's parser (and its subcommands') shows defaults; the commands' modules need not ask."""

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("formatter_class") in (None, argparse.HelpFormatter, argparse.RawDescriptionHelpFormatter):
            kwargs["formatter_class"] = _DefaultsFormatter
        super().__init__(*args, **kwargs)


def parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser for ``argv``'s command (only that command's module is imported) and ``argv`` parsed by it:
    what ``kvtier ARGV`` would run, without running it. argparse's SystemExit on an error or ``--help``."""
    parser = _Parser(prog="kvtier", description="Tiered prefix KV cache for LLM serving.",
                     epilog="kvtier COMMAND --help gives a command's options and their defaults.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, purpose) in COMMANDS.items():
        if argv[:1] == [name]:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=purpose)
    return parser, parser.parse_args(argv)


def _dispatch(argv: list[str]) -> int:
    parser, args = parse(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _dispatch(argv)
    except MissingDependency as exc:
        error: Exception = exc
    except ImportError as exc:
        error = missing_dependency(exc)
        if error is None:
            raise
    command = f"kvtier {argv[0]}" if argv else "kvtier"
    print(f"{command}: {error}", file=sys.stderr)
    return 2
