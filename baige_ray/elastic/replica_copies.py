"""Replica copies in flight: at most one per holder, and the step each holder's replica is at.

The controller starts a copy after a step; the holder copies on a thread of its own while training
runs on. A replica that trails by more than a copy would let a lost node cost more steps than
promised, so before dispatching a step the controller waits for copies that fell behind the floor
(replicas.replica_floor): training stalls only when copying is slower than a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray

from baige_ray.elastic import calls
from baige_ray.elastic.workers import Worker


@dataclass
class HolderCopy:
    worker: Worker
    in_flight: ray.ObjectRef | None = None
    step: int | None = None  # the step of the replica the holder reported last


class ReplicaCopies:
    def __init__(self) -> None:
        self._copies: dict[str, HolderCopy] = {}
        self._sources: dict[int, ray.actor.ActorHandle] = {}
        self.waited_s = 0.0

    @property
    def holders(self) -> list[Worker]:
        return [copy.worker for copy in self._copies.values()]

    def start(self, holders: list[Worker], sources: dict[int, ray.actor.ActorHandle]) -> None:
        """Copy the newest snapshot of each stage (one source each) to every holder not still copying."""
        self._sources = sources
        previous, self._copies = self._copies, {}
        for worker in holders:
            copy = self._copies[worker.name] = previous.get(worker.name) or HolderCopy(worker)
            copy.worker = worker
            if self._collect(copy, timeout_s=0):
                copy.in_flight = worker.actor.copy_replica.remote(sources)

    def clear(self) -> None:
        self._copies = {}

    def wait_for(self, floor: int, timeout_s: float, watched: list | None = None) -> bool:
        """Wait until every holder's replica is at `floor` or newer, starting one more copy where the
        last ended behind it; False when one is not (its holder or a source is gone, or too slow), or as
        soon as one of `watched` (the step in flight) fails: a recovery is due, not a copy."""
        started = time.monotonic()
        deadline = started + timeout_s
        step = StepInFlight(watched or [])
        try:
            return all(self._bring_up(copy, floor, deadline, step) for copy in self._copies.values())
        finally:
            self.waited_s += time.monotonic() - started

    def _bring_up(self, copy: HolderCopy, floor: int, deadline: float, step: StepInFlight) -> bool:
        for _ in range(2):  # the copy in flight, then one begun now (it reads snapshots newer than floor)
            if copy.step is not None and copy.step >= floor:
                return True
            if copy.in_flight is None:
                copy.in_flight = copy.worker.actor.copy_replica.remote(self._sources)
            if not self._collect(copy, deadline - time.monotonic(), step):
                return False
        return copy.step is not None and copy.step >= floor

    @staticmethod
    def _collect(copy: HolderCopy, timeout_s: float, step: StepInFlight | None = None) -> bool:
        """Record the copy in flight once it has ended; False while it runs (at the timeout, or once the
        step in flight failed)."""
        if copy.in_flight is None:
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            watched = step.running if step is not None else []
            ready, _ = calls.wait([copy.in_flight, *watched], timeout=max(0.0, deadline - time.monotonic()))
            if copy.in_flight in ready:
                break
            if not ready or step.failed(ready):
                return False
        try:
            copy.step = calls.get(copy.in_flight)
        except ray.exceptions.RayError:  # the holder is gone: recovery will notice it
            copy.step = None
        copy.in_flight = None
        return True


class StepInFlight:
    """The answers of the step in flight, looked at while the controller waits for something else."""

    def __init__(self, refs: list):
        self.running = list(refs)

    def failed(self, ready: list) -> bool:
        """Whether one of `ready` (answers of this step among them) failed; the ones that did not stop
        being watched."""
        for ref in [ref for ref in ready if ref in self.running]:
            self.running.remove(ref)
            try:
                calls.get(ref, timeout=0)
            except Exception:  # a dead rank or a broken collective
                return True
        return False
