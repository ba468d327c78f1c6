"""The documentation site builds without a warning (mkdocs --strict: broken links, missing pages,
docstrings the API reference cannot render), and every page is in its navigation."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from tests.doc_snippets import REPO_ROOT


def test_the_site_builds_in_strict_mode(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()


def nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())
    on_disk = sorted(str(path.relative_to(REPO_ROOT / "docs")) for path in (REPO_ROOT / "docs").rglob("*.md"))
    assert sorted(nav_pages(config["nav"])) == on_disk
