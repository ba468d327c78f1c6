"""Heartbeats kept in flight to workers that are busy with a long call (a step, a regroup).

A worker answers heartbeats on its control thread, so a busy one answers too; a frozen process
(SIGSTOP, a hung host) answers nothing. One heartbeat per worker is in flight at a time: an answered
one is replaced by the next, and one unanswered for `timeout_s` names its worker silent, however
long the call it is busy with has run. (Waiting for the call first and asking afterwards found a
worker frozen just after its last answer one wait late: a soak's frozen member took 10 s to name.)
"""

from __future__ import annotations

from collections.abc import Hashable

import ray
from ray.exceptions import RayActorError

from baige_ray.elastic import calls

SILENT = "stopped answering heartbeats"


class Heartbeats:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._sent: dict[Hashable, tuple[ray.ObjectRef, float]] = {}  # key -> (heartbeat in flight, sent at)

    def unresponsive(self, workers: dict, now: float) -> dict[Hashable, str]:
        """Of `workers` (a key, such as the rank, -> Worker), those silent for `timeout_s` or whose heartbeat
        says they died (key -> why); sends the next heartbeat to the others and forgets keys not given."""
        self._sent = {key: sent for key, sent in self._sent.items() if key in workers}
        lost = {}
        for key, worker in workers.items():
            sent = self._sent.get(key)
            if sent is not None:
                ref, at = sent
                ready, _ = calls.wait([ref], timeout=0)
                if not ready:
                    if now - at > self.timeout_s:
                        lost[key] = SILENT
                    continue
                died = _death_of(ref)
                if died is not None:
                    # The worker's own call can stay pending for a while after its actor died (Ray waits
                    # for the death's cause before failing it): a heartbeat sent since then fails at once.
                    lost[key] = died
                    continue
            self._sent[key] = (worker.actor.heartbeat.remote(), now)
        return lost


def _death_of(heartbeat: ray.ObjectRef) -> str | None:
    """Why the actor died, where this answered heartbeat says it did; None where it answered."""
    try:
        calls.get(heartbeat, timeout=0)
    except RayActorError as error:
        return f"actor died: {type(error).__name__} (a heartbeat)"
    except Exception:  # an answer that failed otherwise says nothing about the actor's death
        pass
    return None
