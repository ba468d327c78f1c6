"""Every Python snippet of the README and the documentation runs, as a reader would run it: a page's
blocks in order in one namespace (tests/doc_snippets.py), so none can go stale. The pages share one
simulated cluster that each joins through RAY_ADDRESS, started in their own interpreter: the tiers'
shared session is closed first."""

from __future__ import annotations

import re

import pytest

from tests.doc_snippets import REPO_ROOT, documentation_pages, python_blocks, run_pages

PAGES = [page for page in documentation_pages() if python_blocks(page.read_text())]


@pytest.fixture(scope="module", autouse=True)
def no_shared_ray_session(ray_sessions):
    ray_sessions.close()


@pytest.mark.timeout(1260)
def test_every_snippet_of_the_readme_and_the_docs_runs(tmp_path, ray_sessions):
    done = run_pages(PAGES, tmp_path, dashboard_port=ray_sessions.dashboard_port)
    outcomes = dict(re.findall(r"^=== (\S+): (ok|FAILED)", done.stdout, re.M))
    names = [str(page.relative_to(REPO_ROOT)) for page in PAGES]
    assert done.returncode == 0 and all(outcomes.get(name) == "ok" for name in names), \
        f"pages: {outcomes}\n{done.stdout[-12000:]}"
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith("=== ")))


def test_the_readme_and_the_quick_start_have_code_to_run():
    assert {page.name for page in PAGES} >= {"README.md", "quickstart.md"}
