"""``kvtier <command>``: each command lives in its own module exposing ``add_parser(subparsers)``.

The module's parser sets ``func`` (called with the parsed args; its return value is the exit code).
Commands are imported lazily, so ``kvtier --help`` never imports torch or an engine.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: command name -> module implementing it
COMMANDS: dict[str, str] = {
    "demo": "kvtier.apps.demo",
    "serve": "kvtier.apps.serve.cli",
    "bench": "kvtier.apps.bench.cli",
    "route": "kvtier.apps.route.cli",
    "sim": "kvtier.apps.sim.cli",
    "cache": "kvtier.apps.cache.cli",
    "calibrate": "kvtier.apps.calibrate.cli",
    "vllm": "kvtier.integrations.vllm.cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered prefix KV cache for LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if argv[:1] == [name]:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=f"(see kvtier {name} --help)")
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
