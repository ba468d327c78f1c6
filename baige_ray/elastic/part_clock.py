"""Seconds spent in each consecutive part of one piece of work (a regroup on a worker, a recovery)."""

from __future__ import annotations

import time


class PartClock:
    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def mark(self, part: str) -> None:
        """The part named `part` ends now; the next one begins."""
        now = time.perf_counter()
        self.parts[part] = round(now - self._last, 4)
        self._last = now


def slowest_parts(reports: list[dict]) -> dict[str, float]:
    """Per part, the slowest member's seconds (the group waits for it), over `reports` carrying `parts_s`."""
    slowest: dict[str, float] = {}
    for report in reports:
        for part, seconds in (report.get("parts_s") or {}).items():
            slowest[part] = max(slowest.get(part, 0.0), seconds)
    return slowest
