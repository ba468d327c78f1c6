"""The only place baige-ray reads environment variables."""

from __future__ import annotations

import os

RAY_ADDRESS_ENV = "RAY_ADDRESS"


def ray_address() -> str | None:
    """Address of a cluster the user started (`ray start --head`), if any."""
    return os.environ.get(RAY_ADDRESS_ENV) or None


CALIBRATION_DIR_ENV = "BAIGE_RAY_CALIBRATION_DIR"


def calibration_dir() -> str:
    """Where `baige-ray calibrate` keeps one JSON file per cluster fingerprint."""
    return os.environ.get(CALIBRATION_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "baige-ray",
                                                               "calibration")
