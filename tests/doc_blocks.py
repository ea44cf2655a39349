"""The code blocks of the README and the docs, and the shell commands in them, as a reader would type them.

``fenced_blocks`` yields every fenced block with its language and where it starts; ``shell_commands`` joins a
block's continuation lines and multi-line quotes into whole commands, split as the shell would (shlex), without
environment assignments, prompts, trailing ``&`` or comments, and cut at the first pipe, ``;`` or redirection.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_STOPS = {"|", "||", "&&", ";", ">", ">>", "2>", "2>&1", "<"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def fenced_blocks(path: Path) -> Iterator[Block]:
    text = path.read_text()
    for match in _FENCE.finditer(text):
        indent = match.group(1)
        body = "\n".join(line.removeprefix(indent) for line in match.group(3).splitlines())
        yield Block(path, text.count("\n", 0, match.start()) + 1, match.group(2).lower(), body)


def shell_commands(block: Block) -> Iterator[list[str]]:
    """Each whole command of a shell block as argv."""
    pending = ""
    for line in block.text.splitlines():
        line = line.removeprefix("$ ") if not pending else line
        pending = f"{pending}\n{line}" if pending else line
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1]
            continue
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        pending = ""
        while argv and _ASSIGNMENT.match(argv[0]):
            argv.pop(0)
        for i, word in enumerate(argv):
            if word in _STOPS:
                argv = argv[:i]
                break
        if argv and argv[-1] == "&":
            argv.pop()
        if argv:
            yield argv
