"""A replica's reports to its application's serving registry, and what their answers start.

Every `interval_s` a replica reports its recent work, the weights version it serves and whether its
engine is asleep; between reports it waits on the registry (a long poll) for newer weights or for the
replicas to be told to sleep or wake. New weights load in the background while the reports go on: a
replica silent for `STALE_AFTER_S` (3 s) counts as gone, and whoever waits for every replica to load
(`reload_weights`) would stop waiting for it; 2 GB of weights took longer than that to arrive.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class ReplicaSide:
    """What the reports read from, and do to, the replica."""

    report_fields: Callable[[], dict[str, Any]]  # the report's contents, after the replica's id
    state: Callable[[], tuple[int, bool]]  # (weights version it serves, asleep)
    load_newest_weights: Callable[[], Awaitable[None]]
    turn: Callable[[bool], Awaitable[None]]  # fall asleep (True) or wake


async def report_forever(registry: Any, replica: str, side: ReplicaSide, interval_s: float) -> None:
    loading: asyncio.Task | None = None
    while True:
        await registry.report.remote(replica, **side.report_fields())
        if loading is not None:
            await asyncio.wait([loading], timeout=interval_s)
            if loading.done():
                loading, finished = None, loading
                finished.result()  # a load that raised ends the reports
            continue  # report at once that they are loaded
        version, asleep = side.state()
        newest, wanted_asleep = await registry.newer_weights.remote(version, interval_s, asleep)
        if wanted_asleep != asleep and (wanted_asleep or newest == version):
            await side.turn(wanted_asleep)  # waking for new weights is the load's to do
        if newest != version:
            loading = asyncio.ensure_future(side.load_newest_weights())
