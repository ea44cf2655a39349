"""One source for every headline figure: the benchmark record pages under docs/benchmarks/.

Each record page carries a ``## Headline figures`` table (``what | figure``) whose figures its body measured.
The README's headline table (which the site's home page includes) and any guide page's headline table quote a
row of the record they link to, word for word; a figure that disagrees with its record, a row without a record
or a record figure that its own page never measured fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HEADING = re.compile(r"^## Headline figures[ \t]*$", re.MULTILINE)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def headline_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first table after ``## Headline figures``, keyed by its header cells; [] without one."""
    match = HEADING.search(text)
    if not match:
        return []
    table = []
    for line in text[match.end():].lstrip("\n").splitlines():
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif table:
            break
    if len(table) < 2:
        return []
    header, rows = table[0], table[2:]
    return [dict(zip(header, row)) for row in rows]


def outside_headline(text: str) -> str:
    """The page without its ``## Headline figures`` section: what the figures must be found in."""
    match = HEADING.search(text)
    if not match:
        return text
    rest = text[match.end():]
    following = re.search(r"^#{1,2} ", rest, re.MULTILINE)
    return text[:match.start()] + (rest[following.start():] if following else "")


def disagreements(page: Path, text: str) -> list[str]:
    """Every headline row of ``text`` (the page at ``page``) that its linked record does not state as it does."""
    problems = []
    for row in headline_rows(text):
        what, figure = row.get("what", ""), row.get("figure", "")
        links = LINK.findall(row.get("how it was measured", ""))
        records = [(page.parent / link).resolve() for link in links if "://" not in link]
        records = [record for record in records if record.parent == (DOCS / "benchmarks").resolve()]
        if not records:
            problems.append(f"{page.name}: {what!r} links to no record page under docs/benchmarks/")
            continue
        record = records[0]
        quoted = {r.get("what"): r.get("figure") for r in headline_rows(record.read_text())}
        if what not in quoted:
            problems.append(f"{page.name}: {what!r} is not a headline row of {record.name}")
        elif quoted[what] != figure:
            problems.append(f"{page.name}: {what!r} says {figure!r}, {record.name} says {quoted[what]!r}")
    return problems


def test_the_readme_quotes_its_records():
    readme = ROOT / "README.md"
    assert len(headline_rows(readme.read_text())) >= 8
    assert disagreements(readme, readme.read_text()) == []


def test_a_stale_readme_figure_fails():
    readme = ROOT / "README.md"
    text = readme.read_text()
    row = next(row for row in headline_rows(text) if "concurrent traffic" in row["what"])
    stale = text.replace(f"| {row['figure']} |", "| 11.85x vLLM alone's request throughput |", 1)
    assert stale != text
    problems = disagreements(readme, stale)
    assert len(problems) == 1 and row["what"] in problems[0]


def test_guide_pages_quote_their_records():
    pages = [page for page in DOCS.rglob("*.md") if "benchmarks" not in page.relative_to(DOCS).parts]
    problems = [problem for page in pages for problem in disagreements(page, page.read_text())]
    assert problems == []


def test_every_record_figure_is_measured_on_its_page():
    records = sorted((DOCS / "benchmarks").glob("*.md"))
    quoted = 0
    for record in records:
        text = record.read_text()
        body = outside_headline(text)
        for row in headline_rows(text):
            quoted += 1
            missing = [n for n in NUMBER.findall(row["figure"]) if not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", body)]
            assert not missing, f"{record.name}: {row['what']!r} quotes {missing}, which the page never measured"
    assert quoted >= 9
