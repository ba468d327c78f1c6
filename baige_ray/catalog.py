"""What ships inside the package, found by name wherever baige-ray is installed.

The repository's `clusters/` (hardware descriptors) and `examples/models/` (published model configs and
the tables the benchmarks read) install as the packages `baige_ray.clusters` and `baige_ray.published`
(pyproject.toml), so a node that installed the wheel has them without the source tree. A name is a file's
stem (`sim-2x4`, `qwen2.5-0.5b`); anything that looks like a path (a separator or a file suffix, or a
`Path`) stays a path, so a user's own descriptor or config keeps working.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

CLUSTERS_PACKAGE = "baige_ray.clusters"
PUBLISHED_PACKAGE = "baige_ray.published"
MODEL_SUFFIXES = (".json", ".yaml")
# A descriptor's top-level key (topology/descriptor.py); the `ray up` configs beside them lack it.
DESCRIPTOR_KEY = "node_types:"


def shipped_folder(package: str) -> Path:
    """Where `package`'s data lies on this node."""
    # pip unpacks wheels, so the package data is on the file system; a zipped install is not supported.
    return Path(str(resources.files(package)))


def shipped_file(package: str, filename: str) -> Path:
    """The file `filename` shipped in `package` (CLUSTERS_PACKAGE or PUBLISHED_PACKAGE)."""
    path = shipped_folder(package) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{filename!r} is not shipped in {package}: the installation is incomplete")
    return path


def cluster_names() -> list[str]:
    """The hardware descriptors that ship with baige-ray, by name."""
    return sorted(path.stem for path in shipped_folder(CLUSTERS_PACKAGE).glob("*.yaml") if _is_descriptor(path))


def model_names() -> list[str]:
    """The published model configs (Hugging Face config.json and planner YAMLs) that ship, by name."""
    return sorted(path.stem for path in _published_models())


def is_path(reference: str | Path) -> bool:
    """Whether `reference` means a file or directory of the user's rather than something shipped: a `Path`,
    a string with a separator or a file suffix, or one that exists where it points."""
    if isinstance(reference, Path):
        return True
    looks_like_one = "/" in reference or "\\" in reference or Path(reference).suffix in (*MODEL_SUFFIXES, ".yml")
    return looks_like_one or Path(reference).exists()


def cluster_descriptor(reference: str | Path) -> Path:
    """The descriptor file `reference` means: a shipped one by name (`"sim-2x4"`), else a path as given.

    An unknown name is refused with the names there are."""
    if is_path(reference):
        return Path(reference)
    path = shipped_folder(CLUSTERS_PACKAGE) / f"{reference}.yaml"
    if path.is_file() and _is_descriptor(path):
        return path
    why = "is a `ray up` cluster config, not a hardware descriptor" if path.is_file() else "is not a known cluster"
    raise ValueError(f"cluster={reference!r} {why}: expected a descriptor's path or one of the names "
                     f"{', '.join(cluster_names())}")


def published_model(reference: str | Path) -> Path:
    """The model config `reference` means: a shipped one by name (`"qwen2.5-0.5b"`), else a path as given.

    An unknown name is refused with the names there are."""
    if is_path(reference):
        return Path(reference)
    for path in _published_models():
        if path.stem == reference:
            return path
    raise ValueError(f"model={reference!r} is not a known model config: expected a path (a planner YAML, a "
                     f"config.json or a model directory) or one of the names {', '.join(model_names())}")


def _published_models() -> list[Path]:
    folder = shipped_folder(PUBLISHED_PACKAGE)
    # The failure and run tables are data of the benchmarks, not models.
    return [path for path in folder.iterdir()
            if path.suffix in MODEL_SUFFIXES and not path.stem.startswith("published-")]


def _is_descriptor(path: Path) -> bool:
    return any(line.startswith(DESCRIPTOR_KEY) for line in path.read_text().splitlines())
