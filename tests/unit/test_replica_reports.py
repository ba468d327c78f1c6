"""A replica's reports to its serving registry (serving/replica_reports.py): reports go on while new
weights load, so a replica whose load takes longer than the registry's staleness window (3 s; 2 GB of
weights took 14 s once) is still waited for; the replicas sleep and wake as the registry asks."""

from __future__ import annotations

import asyncio
import time

from baige_ray.serving.replica_reports import ReplicaSide, report_forever


class Remote:
    def __init__(self, function):
        self.remote = function


class Registry:
    """The registry's side of the protocol: reports recorded, a long poll answered with what is published."""

    def __init__(self):
        self.version, self.asleep = 1, False
        self.reports: list[tuple[float, int, bool]] = []
        self.report = Remote(self._report)
        self.newer_weights = Remote(self._newer_weights)

    async def _report(self, replica: str, loaded_version: int, asleep: bool) -> int:
        self.reports.append((time.monotonic(), loaded_version, asleep))
        return self.version

    async def _newer_weights(self, version: int, timeout_s: float, asleep: bool) -> tuple[int, bool]:
        deadline = time.monotonic() + timeout_s
        while (self.version, self.asleep) == (version, asleep) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.version, self.asleep


class Replica:
    def __init__(self, registry: Registry, load_s: float):
        self.registry, self.load_s = registry, load_s
        self.version, self.asleep = 1, False
        self.side = ReplicaSide(report_fields=lambda: {"loaded_version": self.version, "asleep": self.asleep},
                                state=lambda: (self.version, self.asleep), load_newest_weights=self.load,
                                turn=self.turn)

    async def load(self) -> None:
        await asyncio.sleep(self.load_s)
        self.version, self.asleep = self.registry.version, False

    async def turn(self, asleep: bool) -> None:
        self.asleep = asleep


def test_reports_go_on_while_weights_load_and_the_next_one_says_they_are_loaded():
    registry = Registry()
    replica = Replica(registry, load_s=1.0)

    async def scenario():
        reporting = asyncio.ensure_future(report_forever(registry, "r", replica.side, interval_s=0.1))
        await asyncio.sleep(0.3)
        published = time.monotonic()
        registry.version = 2
        while replica.version != 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        reporting.cancel()
        return published

    published = asyncio.run(scenario())
    during = [at for at, version, _ in registry.reports if published < at and version == 1]
    assert len(during) >= 5  # every 0.1 s through a 1 s load: never silent long enough to count as gone
    assert registry.reports[-1][1] == 2


def test_replicas_fall_asleep_and_wake_as_the_registry_asks():
    registry = Registry()
    replica = Replica(registry, load_s=0.0)

    async def scenario():
        reporting = asyncio.ensure_future(report_forever(registry, "r", replica.side, interval_s=0.1))
        registry.asleep = True
        while not replica.asleep:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        asleep_reported = registry.reports[-1][2]
        registry.asleep = False
        while replica.asleep:
            await asyncio.sleep(0.01)
        reporting.cancel()
        return asleep_reported

    assert asyncio.run(scenario()) is True
