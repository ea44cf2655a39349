"""The import layers (pyproject.toml's import-linter contracts) also hold for modules named in strings: a lower
layer never names a higher layer's module for a lazy import (importlib, a registry entry), which lint-imports
cannot see."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "kvtier"
MODULE = re.compile(r"^(kvtier(?:\.\w+)+)(?::\w+)?$")


def layers() -> list[list[str]]:
    """The layers contract's layers, highest first, each a list of its (independent) packages."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in contracts if c["type"] == "layers")
    return [[p.strip() for p in re.split(r"[|:]", layer)] for layer in contract["layers"]]


def rank(module: str, ordered: list[list[str]]) -> int | None:
    """The layer of ``module`` (0 = highest), by its longest listed package; None if no layer holds it."""
    best = None
    for i, layer in enumerate(ordered):
        for package in layer:
            if (module == package or module.startswith(package + ".")) and (best is None or len(package) > best[1]):
                best = (i, len(package))
    return None if best is None else best[0]


def named_modules(path: Path) -> set[str]:
    return {m.group(1) for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and (m := MODULE.match(node.value))}


def test_no_module_names_a_module_of_a_higher_layer_in_a_string():
    ordered = layers()
    assert rank("kvtier.base.metric_decls", ordered) == len(ordered) - 1  # the parsing finds the ground
    upward = {}
    for path in SOURCE.rglob("*.py"):
        module = ".".join(("kvtier", *path.relative_to(SOURCE).with_suffix("").parts)).removesuffix(".__init__")
        own = rank(module, ordered)
        if own is None:
            continue  # the package root: above every layer
        for name in named_modules(path):
            other = rank(name, ordered)
            if other is not None and other < own:
                upward.setdefault(module, []).append(name)
    assert upward == {}
