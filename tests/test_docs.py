"""The README is a landing page whose links land: every relative link names a file of this checkout.

The site under docs/ is checked by ``mkdocs build --strict`` in scripts/test.sh; the README is not part of
the site, so its links are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_links_name_files_of_this_checkout():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links to its docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_readme_stays_a_landing_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200  # the rest belongs in docs/
