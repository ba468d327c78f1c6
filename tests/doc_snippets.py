"""Run the Python code blocks of a Markdown page the way a reader would: in order, in one process.

A page's ```python blocks share one namespace, like cells of a notebook: a later block may use what an
earlier one made. A page runs in an empty working directory, outside the repository, as a user's script
runs on a node that installed the wheel: descriptors and published configs are named (`"sim-2x4"`), not
reached by a path into a checkout. Blocks in other languages (bash, yaml) are not run here.

`run_page` runs one page in a fresh interpreter, as a reader would. `run_pages` runs many in one
interpreter beside one simulated cluster that every page joins (RAY_ADDRESS, as on a real cluster): the
test suite's way, which pays for imports and the cluster once instead of once a page.

    python -m tests.doc_snippets docs/quickstart.md    # run one page, print its output
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```\s*$", re.S | re.M)


def python_blocks(markdown: str) -> list[str]:
    return PYTHON_BLOCK.findall(markdown)


def documentation_pages() -> list[Path]:
    """README.md and every page of the docs site."""
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def page_script(page: Path) -> str:
    blocks = python_blocks(page.read_text())
    return "\n\n".join(f"# --- {page.name}, block {index + 1}\n{block}" for index, block in enumerate(blocks))


def run_page(page: Path, workdir: Path, *, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run the page's blocks in a new interpreter inside `workdir`; returns the finished process."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-c", page_script(page)], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


SHARED_RUNNER = """
import json, os, signal, sys, time, traceback
from pathlib import Path

import ray

from baige_ray.topology.descriptor import load_descriptor
from baige_ray.topology.simulated import SimulatedCluster

pages, workdir = json.loads(sys.argv[1]), Path(sys.argv[2])
PAGE_LIMIT_S = int(sys.argv[3])
DASHBOARD_PORT = json.loads(sys.argv[4])  # None: Ray's default


def too_long(signum, frame):
    raise TimeoutError(f"the page ran past {PAGE_LIMIT_S}s")


signal.signal(signal.SIGALRM, too_long)
cluster = SimulatedCluster(load_descriptor("sim-2x4"), dashboard_port=DASHBOARD_PORT).start()
ray.shutdown()  # the cluster stays; each page joins it as its own driver
os.environ["RAY_ADDRESS"] = cluster.address
failed = []
try:
    for page, script in pages:
        folder = workdir / Path(page).stem
        folder.mkdir(parents=True, exist_ok=True)
        os.chdir(folder)
        began = time.monotonic()
        signal.alarm(PAGE_LIMIT_S)  # a page that hangs fails alone; the others still run
        try:
            exec(compile(script, page, "exec"), {"__name__": "__main__"})
        except BaseException:
            failed.append(page)
            print(f"=== {page}: FAILED after {time.monotonic() - began:.1f}s", flush=True)
            traceback.print_exc(file=sys.stdout)
        else:
            print(f"=== {page}: ok in {time.monotonic() - began:.1f}s", flush=True)
        finally:
            signal.alarm(0)
            if ray.is_initialized():
                ray.shutdown()
finally:
    cluster.shutdown()
sys.exit(1 if failed else 0)
"""


def run_pages(pages: list[Path], workdir: Path, *, page_limit_s: int = 180, timeout_s: float = 1200,
              dashboard_port: int | None = None) -> subprocess.CompletedProcess:
    """Run each page's blocks, page after page, in one new interpreter beside one simulated cluster (its
    dashboard on `dashboard_port`, Ray's default when None); the output says `=== PAGE: ok in Ns` or
    `=== PAGE: FAILED` with the traceback, page by page. A page running past `page_limit_s` fails with a
    TimeoutError and the next one runs."""
    scripts = [(str(page.relative_to(REPO_ROOT)), page_script(page)) for page in pages]
    # The simulated cluster asks for no token, whatever ~/.ray holds: a Ray session this process opened
    # earlier may have set RAY_AUTH_MODE=token here, which would start the cluster with token auth.
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS" and not key.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"
    return subprocess.run([sys.executable, "-c", SHARED_RUNNER, json.dumps(scripts), str(workdir),
                           str(page_limit_s), json.dumps(dashboard_port)],
                          cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s)


if __name__ == "__main__":
    import tempfile

    for argument in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as folder:
            done = run_page(Path(argument).resolve(), Path(folder))
            print(done.stdout, end="")
            print(done.stderr[-4000:], end="", file=sys.stderr)
            print(f"{argument}: exit {done.returncode}", file=sys.stderr)
