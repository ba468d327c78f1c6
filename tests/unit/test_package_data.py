"""What the wheel holds is what the code reads: the cluster descriptors and published model configs ship as
package data and are found by name, and no module reaches out of its package by a path relative to its own
file (which would find the repository in a checkout and nothing on a node that installed the wheel)."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

from baige_ray import catalog
from baige_ray.planner.model_spec import load_model_spec
from baige_ray.topology.descriptor import load_descriptor
from tests.doc_snippets import REPO_ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]
# The source folders that install as the package's top or as one of its top-level sub-packages.
SOURCE_ROOTS = sorted({REPO_ROOT / folder for folder in PACKAGE_DIRS.values()})


def _steps_up(node: ast.AST) -> int | None:
    """How many folders above the file `node` climbs, when `node` is a path built from `__file__`
    (`Path(__file__).resolve().parents[2]`, `.parent.parent`, `os.path.dirname(os.path.dirname(__file__))`)."""
    if isinstance(node, ast.Name):
        return 0 if node.id == "__file__" else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
        base = _steps_up(node.value.value)
        index = node.slice.value if isinstance(node.slice, ast.Constant) else 99
        return None if base is None else base + index + 1
    if isinstance(node, ast.Attribute):
        base = _steps_up(node.value)
        return None if base is None else base + (node.attr == "parent")
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name == "resolve" and isinstance(node.func, ast.Attribute):
            return _steps_up(node.func.value)
        if name in ("Path", "dirname", "abspath", "realpath") and node.args:
            base = _steps_up(node.args[0])
            return None if base is None else base + (name == "dirname")
    return None


def _escapes(source: Path, root: Path) -> list[str]:
    """Expressions of `source` that climb above `root`, the folder its package starts at."""
    allowed = len(source.relative_to(root).parts)  # from the file up to `root` itself
    found = []
    for node in ast.walk(ast.parse(source.read_text())):
        steps = _steps_up(node)
        if steps is not None and steps > allowed:
            found.append((node.lineno, f"{source.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}"))
    return [line for _, line in sorted(found)]


def test_no_module_reaches_outside_its_package_by_a_path_from_its_own_file():
    escapes = [line for root in SOURCE_ROOTS for source in sorted(root.rglob("*.py"))
               for line in _escapes(source, root)]
    assert escapes == []


def test_the_escape_check_sees_the_usual_spellings(tmp_path):
    module = tmp_path / "pkg" / "sub" / "mod.py"
    module.parent.mkdir(parents=True)
    module.write_text("from pathlib import Path\nimport os\n"
                      "A = Path(__file__).resolve().parents[2] / 'clusters'\n"
                      "B = Path(__file__).parent.parent.parent\n"
                      "C = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))\n"
                      "D = Path(__file__).resolve().parents[1]\n"  # the package's own top: allowed
                      "E = Path(__file__).parent\n")
    assert [line.split(": ")[0].rsplit(":", 1)[1] for line in _escapes(module, tmp_path / "pkg")] == ["3", "4", "5"]


def test_every_data_file_of_the_shipped_folders_is_package_data():
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package in (catalog.CLUSTERS_PACKAGE, catalog.PUBLISHED_PACKAGE):
        folder = REPO_ROOT / PACKAGE_DIRS[package]
        left_out = [path.name for path in folder.iterdir()
                    if path.is_file() and path.suffix != ".py"
                    and not any(fnmatch.fnmatch(path.name, pattern) for pattern in globs[package])]
        assert left_out == [], f"{package}: {left_out} would be missing from the wheel"


def test_every_shipped_descriptor_and_model_config_loads_by_name():
    assert {"sim-2x4", "sim-4x2", "h100-rail-2048"} <= set(catalog.cluster_names())
    assert "aws-h100" not in catalog.cluster_names()  # a `ray up` config, not a descriptor
    for name in catalog.cluster_names():
        assert load_descriptor(name).name
    assert {"qwen2.5-0.5b", "gpt-175b", "llama-3-8b"} <= set(catalog.model_names())
    for name in catalog.model_names():
        assert load_model_spec(name).num_layers > 0
    assert catalog.shipped_file(catalog.PUBLISHED_PACKAGE, "SOURCES.md").read_text().strip()


def test_a_path_still_works_and_an_unknown_name_is_refused_with_the_names_there_are(tmp_path):
    own = tmp_path / "mine.yaml"
    own.write_text(catalog.cluster_descriptor("sim-2x4").read_text())
    assert load_descriptor(own) == load_descriptor("sim-2x4") == load_descriptor(str(own))
    with pytest.raises(ValueError, match=r"cluster='sim-9x9' is not a known cluster.*sim-2x4"):
        load_descriptor("sim-9x9")
    with pytest.raises(ValueError, match=r"'aws-h100' is a `ray up` cluster config"):
        load_descriptor("aws-h100")
    with pytest.raises(ValueError, match=r"path='clusters/nope.yaml' is invalid.*sim-2x4"):
        load_descriptor("clusters/nope.yaml")
    with pytest.raises(ValueError, match=r"model='llama-9' is not a known model config.*qwen2.5-0.5b"):
        load_model_spec("llama-9")


def test_the_version_is_one_number_from_the_package_the_metadata_and_the_command(capsys):
    from importlib import metadata

    import baige_ray
    from baige_ray.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert printed == f"baige-ray {baige_ray.__version__}" == f"baige-ray {metadata.version('baige-ray')}"
