"""MkDocs hook: the configuration and metrics reference pages, generated from the code on every build.

``reference/configuration.md`` comes from the frozen config dataclasses listed in ``CONFIG_CLASSES`` (the one
place that names them): every init field, its type, default and environment variable, described by the
class's docstring (the clause that names the field in double backquotes) and any ``#:`` comment on the
field's line, looked up along the MRO so a field inherited from a shared base is documented where it is
declared. ``reference/metrics.md`` comes from ``kvtier.metric_owners.declared()``. Neither page exists in
``docs/``, so a renamed field, a new tier option or a new metric shows up in the site without an edit, and a
config class that moved fails the build with the path to fix here.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import fnmatch
import importlib
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]

#: ``module:Class`` of every config documented, in page order; (title, environment prefix or None).
CONFIG_CLASSES: dict[str, tuple[str, str | None]] = {
    "kvtier.core.config:CacheConfig": ("The cache (`CacheConfig`)", "KVTIER_"),
    "kvtier.tiers.memory:MemoryTierConfig": ("`kind: memory`", "KVTIER_MEMORY_"),
    "kvtier.tiers.disk:DiskTierConfig": ("`kind: disk`", "KVTIER_DISK_"),
    "kvtier.tiers.redis:RedisTierConfig": ("`kind: redis`", "KVTIER_REDIS_"),
    "kvtier.tiers.mooncake:MooncakeTierConfig": ("`kind: mooncake`", "KVTIER_MOONCAKE_"),
}
CONFIG_PAGE = "reference/configuration.md"
METRICS_PAGE = "reference/metrics.md"
NO_DOC = "*(not described in the source)*"


def on_files(files: Files, config) -> Files:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # document this checkout, whatever kvtier is installed
    files.append(File.generated(config, CONFIG_PAGE, content=config_page()))
    files.append(File.generated(config, METRICS_PAGE, content=metrics_page()))
    return files


# -- configuration ---------------------------------------------------------------------------------------------

def load(path: str) -> type:
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"docs/hooks/reference.py: CONFIG_CLASSES names {path!r}, which does not import "
                           f"({exc}); point it at the class's new home") from exc
    if not dataclasses.is_dataclass(cls):
        raise RuntimeError(f"docs/hooks/reference.py: {path} is not a dataclass")
    return cls


def config_page() -> str:
    out = ["# Configuration reference", "",
           ("Generated from the config classes on every build of this site (`docs/hooks/reference.py`), so it "
            "always matches the code. How the options fit together, with examples: "
            "[Configuration](../configuration.md). Sizes (`*_bytes`) take `KiB/MiB/GiB`, `KB/MB/GB` or plain "
            "bytes; unknown options and malformed values are errors that name the option."), ""]
    for path, (title, env_prefix) in CONFIG_CLASSES.items():
        out += config_section(load(path), path, title, env_prefix)
    return "\n".join(out)


def config_section(cls: type, path: str, title: str, env_prefix: str | None) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = [f"## {title}", "", f"`{path.replace(':', '.')}`", ""]
    summary = first_sentence(inspect.getdoc(cls) or "")
    if summary:
        lines += [summary, ""]
    lines += ["| option | type | default | environment | meaning |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        env = f"`{env_prefix}{field.name.upper()}`" if env_prefix else ""
        lines.append(f"| `{field.name}` | {type_name(hints[field.name])} | {default_of(field)} | {env} | "
                     f"{cell(describe(cls, field.name, hints[field.name]))} |")
    return lines + [""]


def describe(cls: type, name: str, hint: typing.Any) -> str:
    """What the source says about field ``name``: the first class along the MRO that mentions it wins."""
    for klass in cls.__mro__:
        if name not in vars(klass).get("__annotations__", {}):
            continue
        parts = [p for p in (docstring_clause(klass, name), comment_of(klass, name)) if p]
        if parts:
            return "; ".join(parts) + enum_values(hint)
    for klass in cls.__mro__:  # declared in a base without a word about it; perhaps a subclass explains it
        clause = docstring_clause(klass, name)
        if clause:
            return clause + enum_values(hint)
    return (NO_DOC + enum_values(hint)).strip()


def docstring_clause(klass: type, name: str) -> str:
    doc = " ".join((vars(klass).get("__doc__") or "").split())
    for clause in clauses(doc):
        mentioned = re.findall(r"``([\w*]+)``", clause)
        if any(fnmatch.fnmatchcase(name, m) for m in mentioned):
            # drop a leading "``a`` / ``b``:" naming the fields; keep the rest as written
            return re.sub(r"^(``[\w*]+``\s*/?\s*)+:\s*", "", clause).rstrip(".;: ")
    return ""


def clauses(text: str) -> list[str]:
    """Split at ';' and at sentence ends, never inside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        end = ch == ";" or (ch == "." and re.match(r"\.\s+[A-Z`]", text[i:i + 3]))
        if depth == 0 and end:
            out.append(text[start:i + 1].strip())
            start = i + 1
    out.append(text[start:].strip())
    return [c for c in out if c]


def comment_of(klass: type, name: str) -> str:
    """The ``#:`` comment on the line that declares ``name`` in ``klass``'s own source."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return ""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            _, _, comment = lines[node.end_lineno - 1].partition("#:")
            return comment.strip()
    return ""


def enum_values(hint: typing.Any) -> str:
    hint = unoptional(hint)
    if not (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return ""
    values = []
    for member in hint:
        comment = enum_member_comment(hint, member.name)
        values.append(f"`{member.value}`" + (f": {comment}" if comment else ""))
    return ". Values: " + "; ".join(values)


def enum_member_comment(cls: type, member: str) -> str:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return ""
    for line in source.splitlines():
        if re.match(rf"\s*{member}\s*=", line) and "#:" in line:
            return line.partition("#:")[2].strip()
    return ""


def unoptional(hint: typing.Any) -> typing.Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_args(hint) and type(None) in typing.get_args(hint) and len(args) == 1 else hint


def type_name(hint: typing.Any) -> str:
    optional = type(None) in typing.get_args(hint)
    base = unoptional(hint)
    if isinstance(base, type) and issubclass(base, enum.Enum):
        text = " \\| ".join(f"`{m.value}`" for m in base)
    elif isinstance(base, type) and not typing.get_args(base):
        text = base.__name__
    else:
        text = re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", str(base)).replace("|", "\\|")  # no module paths
    return f"{text} or none" if optional else text


def default_of(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and field.name.endswith("_bytes"):
        return f"`{size(value)}`"
    if isinstance(value, tuple) and value and all(hasattr(v, "kind") for v in value):  # the tier chain
        return ", ".join(f"one `{v.kind}` tier" for v in value)
    text = str(value)
    return f"`{text}`" if text else "`\"\"`"


def size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def first_sentence(doc: str) -> str:
    first = clauses(" ".join(doc.split("\n\n")[0].split()))
    text = first[0] if first else ""
    return "" if "``" in text.split(":")[0] else text  # a docstring that opens with field notes has none


def cell(text: str) -> str:
    return re.sub(r"``([^`]+)``", r"`\1`", text).replace("|", "\\|")


# -- metrics ---------------------------------------------------------------------------------------------------

def metrics_page() -> str:
    out = ["# Metrics reference", "",
           ("Generated on every build of this site from the declarations in the code "
            "(`kvtier.metric_owners.declared()`, by `docs/hooks/reference.py`). Where to scrape them and how "
            "to read them: [Metrics](../metrics.md)."), ""]
    declared = importlib.import_module("kvtier.metric_owners").declared
    out += ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for metric in sorted(declared(), key=lambda m: m.name):
        kind = getattr(metric.kind, "name", metric.kind)
        labels = ", ".join(f"`{label}`" for label in metric.labels) or ""
        out.append(f"| `{metric.name}` | {str(kind).lower()} | {labels} | {cell(metric.help)} |")
    return "\n".join(out + [""])
