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
    from kvtier.base import metrics

    declared = [SimpleNamespace(name="kvtier_b_total", kind="counter", help="B | C.", labels=("tier",)),
                SimpleNamespace(name="kvtier_a_seconds", kind=SimpleNamespace(name="HISTOGRAM"), help="A.", labels=())]
    monkeypatch.setattr(metrics, "declared", lambda: declared)
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
    from kvtier.base.metrics import declared

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
