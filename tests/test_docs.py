"""The README is a landing page whose links land: every relative link names a file of this checkout.

The site under docs/ is checked by ``mkdocs build --strict`` in scripts/test.sh; the README is not part of
the site, so its links are checked here.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

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


def _hook():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metrics_reference_lists_every_declared_metric(monkeypatch):
    from kvtier import metric_owners

    declared = [SimpleNamespace(name="kvtier_b_total", kind="counter", help="B | C.", labels=("tier",)),
                SimpleNamespace(name="kvtier_a_seconds", kind=SimpleNamespace(name="HISTOGRAM"), help="A.", labels=())]
    monkeypatch.setattr(metric_owners, "declared", lambda: declared)
    page = _hook().metrics_page()
    assert "| `kvtier_a_seconds` | histogram |  | A. |" in page
    assert "| `kvtier_b_total` | counter | `tier` | B \\| C. |" in page
    assert page.index("kvtier_a_seconds") < page.index("kvtier_b_total")


def test_configuration_reference_documents_every_field_of_every_config():
    import dataclasses

    hook = _hook()
    page = hook.config_page()
    for path in hook.CONFIG_CLASSES:
        for field in dataclasses.fields(hook.load(path)):
            assert f"| `{field.name}` |" in page, (path, field.name)
    row = "| `capacity_bytes` | int | `64GiB` | `KVTIER_DISK_CAPACITY_BYTES` | hard limit on stored blob bytes |"
    assert row in page


def test_metrics_reference_is_generated_from_the_real_declarations():
    from kvtier.metric_owners import declared

    page = _hook().metrics_page()
    names = [metric.name for metric in declared()]
    assert "kvtier_hit_tokens_total" in names
    assert all(f"| `{name}` |" in page for name in names)


def test_every_docs_page_is_in_the_sites_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert pages
    missing = [page for page in pages if page not in nav]
    assert not missing, f"pages no reader can reach from the site's navigation: {missing}"


def _record_pages() -> set[str]:
    """The pages of the site's Benchmarks section: the dated records of benchmark runs."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    section = next(entry["Benchmarks"] for entry in nav if isinstance(entry, dict) and "Benchmarks" in entry)
    pages = {item if isinstance(item, str) else next(iter(item.values())) for item in section}
    assert "benchmarks/vllm-serve.md" in pages
    return pages


#: What belongs in a record, not a guide: issue numbers, run timestamps, load averages, "the 21:43 run". A bare
#: date is allowed (a survey of other projects is dated).
LAB_NOTES = re.compile(r"(?<![\w(/])#\d|\bissues? #?\d|\d{1,2}:\d{2}(?:-\d{1,2}:\d{2})? UTC|\b\d{1,2}:\d{2} run\b"
                       r"|load average|what changed since", re.IGNORECASE)


def test_guides_carry_no_issue_numbers_or_run_history():
    records = _record_pages()
    guides = [p for p in (ROOT / "docs").rglob("*.md") if p.relative_to(ROOT / "docs").as_posix() not in records]
    assert len(guides) > 20
    notes = [f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}"
             for page in guides + [ROOT / "README.md"]
             for number, line in enumerate(page.read_text().splitlines(), 1)
             for match in [LAB_NOTES.search(line)] if match]
    assert not notes, f"run history in guide pages (move it to a record under docs/benchmarks/): {notes}"


def test_no_page_names_an_issue():
    pages = list((ROOT / "docs").rglob("*.md"))
    hits = [str(p.relative_to(ROOT)) for p in pages if re.search(r"(?<![\w(/])#\d|\bissues? #?\d", p.read_text(), re.I)]
    assert not hits, f"issue numbers in the docs: {hits}"


def test_the_home_page_includes_the_readme():
    assert "--8<-- \"README.md\"" in (ROOT / "docs" / "index.md").read_text()
    assert len((ROOT / "docs" / "index.md").read_text().splitlines()) <= 3  # included, not copied
    site = _readme_hook().readme_for_site("[a](docs/tiers/disk.md#x) [b](docs/) [c](https://e.org/docs/y)")
    assert site == "[a](tiers/disk.md#x) [b](index.md) [c](https://e.org/docs/y)"
    with pytest.raises(Exception, match="outside docs/"):
        _readme_hook().readme_for_site("[s](scripts/setup.sh)")


def _readme_hook():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("docs_readme_hook", ROOT / "docs" / "hooks" / "readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
