"""The only place baige-ray reads environment variables."""

from __future__ import annotations

import os

RAY_ADDRESS_ENV = "RAY_ADDRESS"


def ray_address() -> str | None:
    """Address of a cluster the user started (`ray start --head`), if any."""
    return os.environ.get(RAY_ADDRESS_ENV) or None
