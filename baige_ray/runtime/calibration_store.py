"""Where calibrations are kept: one JSON file per graph fingerprint (constants.calibration_dir).

`baige-ray calibrate` (jobs/calibrate.py) writes them; `baige-ray plan` and `fit(layout="auto")`
read the one of their cluster.
"""

from __future__ import annotations

import logging
from pathlib import Path

from baige_ray.planner.calibration import Calibration, graph_fingerprint
from baige_ray.topology.graph import ResourceGraph

logger = logging.getLogger(__name__)


def cache_path(fingerprint: str, directory: str | Path | None = None) -> Path:
    from baige_ray.constants import calibration_dir

    return Path(directory or calibration_dir()) / f"{fingerprint}.json"


def load_calibration(graph: ResourceGraph, directory: str | Path | None = None) -> Calibration | None:
    """The kept calibration of this hardware, or None (none kept, or one written by another version)."""
    path = cache_path(graph_fingerprint(graph), directory)
    if not path.is_file():
        return None
    try:
        return Calibration.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring calibration %s: %s", path, error)
        return None


def save_calibration(calibration: Calibration, directory: str | Path | None = None) -> Path:
    path = cache_path(calibration.fingerprint, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(calibration.to_json())
    temporary.replace(path)
    return path
