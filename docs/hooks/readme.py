"""MkDocs hook: the site's home page is the README, included rather than copied.

``docs/index.md`` holds the line ``--8<-- "README.md"``; ``on_page_markdown`` replaces it with the README's
text before the page is converted, each link into ``docs/`` made relative to the site (``docs/tiers/disk.md``
becomes ``tiers/disk.md``), so MkDocs checks the included links and anchors in strict mode as it checks any
page's. A README link to a file outside ``docs/`` has no page on the site: the build fails and names it, so the
README and the site cannot drift apart.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r'^--8<-- "README\.md"[ \t]*$', re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not INCLUDE.search(markdown):
        return markdown
    readme = readme_for_site((ROOT / "README.md").read_text())
    return INCLUDE.sub(lambda _match: readme, markdown)


def readme_for_site(text: str) -> str:
    """The README with its links rewritten for a page at the root of ``docs/``; raises on a link outside it."""
    def relink(match: re.Match) -> str:
        target = match.group(1)
        if "://" in target or target.startswith(("#", "mailto:")):
            return match.group(0)
        path, hash_, anchor = target.partition("#")
        if path in ("docs", "docs/"):
            return f"](index.md{hash_}{anchor})"
        if not path.startswith("docs/"):
            raise PluginError(f"README.md links to {target!r}, outside docs/: the site's home page includes "
                              "the README, so link a page under docs/ or an absolute URL")
        return f"]({path[len('docs/'):]}{hash_}{anchor})"
    return LINK.sub(relink, text)
