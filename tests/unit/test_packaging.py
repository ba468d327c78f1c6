"""The install layout the design card fixes: actors/ and policies/ live under baige_ray only."""

import importlib
import importlib.metadata
import sysconfig
import tomllib

from ..conftest import REPO_ROOT


def _declared_packages() -> tuple[list[str], dict[str, str]]:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return config["packages"], config["package-dir"]


def test_every_source_package_is_declared():
    packages, package_dir = _declared_packages()
    found = set()
    for name, directory in package_dir.items():
        root = REPO_ROOT / directory
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root).parts
            if not any(part.startswith((".", "_")) for part in relative):
                found.add(".".join((name, *relative)))
    assert found == set(packages)


def test_actors_and_policies_import_as_subpackages():
    for name in ("baige_ray", "baige_ray.actors", "baige_ray.policies"):
        importlib.import_module(name)


def _installed_distribution() -> importlib.metadata.Distribution:
    # Look in site-packages only: the checkout's own build metadata may also be on sys.path.
    site_packages = sysconfig.get_paths()["purelib"]
    (distribution,) = importlib.metadata.distributions(name="baige-ray", path=[site_packages])
    return distribution


def test_no_top_level_actors_or_policies_installed():
    distribution = _installed_distribution()
    top_levels = {file.parts[0] for file in distribution.files or []}
    assert not top_levels & {"actors", "policies"}
    assert set((distribution.read_text("top_level.txt") or "").split()) <= {"baige_ray"}


def test_console_script_points_at_cli():
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["baige-ray"] == "baige_ray.cli:main"
