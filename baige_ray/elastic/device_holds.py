"""Devices a resize let go of, kept free for a while for whoever the job shrank for.

A lend shrinks the job so that a serving replica can start on the freed device, but Ray reserves
nothing between the shrink and the replica's placement: a warm spare started in that gap would take
the device and leave the replica pending. Spares therefore start only on free devices beyond those
held here.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ReleasedDevices:
    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic):
        self.hold_s, self.clock = hold_s, clock
        self._holds: list[tuple[float, int]] = []  # (until, devices)

    def hold(self, count: int) -> None:
        if count > 0 and self.hold_s > 0:
            self._holds.append((self.clock() + self.hold_s, count))

    def end(self) -> None:
        """The job is asked to grow again: what it let go of is its own once more."""
        self._holds = []

    def held(self) -> int:
        now = self.clock()
        self._holds = [(until, count) for until, count in self._holds if until > now]
        return sum(count for _, count in self._holds)
