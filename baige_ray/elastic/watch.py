"""Waiting for one step on every worker while watching for dead, frozen and hung ranks.

A rank is lost when its process exited (its connection to the controller closed: liveness.py), when
its actor died (Ray's notice, which can take seconds to fail a call in flight), when it stops
answering heartbeats (a frozen process), or when its
step is still running well past the deadline after which every collective has
timed out (a hang nothing else explains). Survivors whose collectives failed
because of a lost peer raise and come back on their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from baige_ray.elastic import calls
from baige_ray.elastic.heartbeats import Heartbeats
from baige_ray.elastic.workers import Worker


@dataclass
class StepOutcome:
    metrics: list[dict | None]
    lost: dict[int, str] = field(default_factory=dict)  # rank -> why
    failed: dict[int, str] = field(default_factory=dict)  # rank -> error (alive, but its step raised)
    # Lost ranks whose process still answers (a step past its deadline, e.g. a pipeline send to a
    # dead stage that gloo cannot interrupt): their snapshots can be read before they are stopped.
    wedged: set[int] = field(default_factory=set)
    first_failure_at: float | None = None

    @property
    def ok(self) -> bool:
        return not self.lost and not self.failed


@dataclass(frozen=True)
class WatchTimes:
    deadline_s: float  # the step (and every collective in it) should be over by then
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    poll_s: float = 0.05  # how often exited processes are looked for while no answer comes


def nothing_exited(workers: list[Worker]) -> set[str]:
    return set()


def watch_step(workers: list[Worker], refs: list[ray.ObjectRef], times: WatchTimes,
               exited: Callable[[list[Worker]], set[str]] = nothing_exited) -> StepOutcome:
    """Every rank's answer to its step, or why there is none. `exited(workers)`: the names of those whose
    process has exited (WorkerPool.exited)."""
    outcome = StepOutcome(metrics=[None] * len(refs))
    started = beaten = time.monotonic()
    heartbeats = Heartbeats(times.heartbeat_timeout_s)
    pending = set(range(len(refs)))
    while pending:
        # Back at least every poll_s: a failure or an exited process is seen that soon (waiting for every
        # answer or the heartbeat interval delayed each recovery by up to 0.25 s). Only the answers that
        # came in are fetched: a job of a thousand ranks polls often.
        rank_of = {refs[rank]: rank for rank in pending}
        ready, _ = calls.wait(list(rank_of), num_returns=len(rank_of),
                              timeout=min(times.poll_s, times.heartbeat_interval_s))
        for ref in ready:
            if _collect(rank_of[ref], ref, outcome):
                pending.discard(rank_of[ref])
        gone = exited([workers[rank] for rank in pending])
        for rank in [rank for rank in pending if workers[rank].name in gone]:
            outcome.lost[rank] = "process exited (its connection to the controller closed)"
            pending.discard(rank)
        now = time.monotonic()
        if outcome.first_failure_at is None and (outcome.lost or outcome.failed):
            outcome.first_failure_at = now
            for rank in pending:  # survivors waiting on the lost peer: let go now, not at the timeout
                workers[rank].actor.abort_step.remote()
        if pending and now - beaten >= times.heartbeat_interval_s:
            beaten = now
            for rank, why in heartbeats.unresponsive({rank: workers[rank] for rank in pending}, now).items():
                outcome.lost[rank] = why
                pending.discard(rank)
        since = outcome.first_failure_at if outcome.first_failure_at is not None else started
        if pending and now - since > times.deadline_s + times.heartbeat_timeout_s:
            for rank in pending:
                outcome.lost[rank] = f"step still running {now - started:.1f}s after it began"
                outcome.wedged.add(rank)
            pending.clear()
    return outcome


def _collect(rank: int, ref: ray.ObjectRef, outcome: StepOutcome) -> bool:
    try:
        outcome.metrics[rank] = calls.get(ref, timeout=0)
    except GetTimeoutError:
        return False
    except RayActorError as error:
        outcome.lost[rank] = f"actor died: {type(error).__name__}"
    except Exception as error:  # the step raised in a live worker, e.g. a collective with a lost peer
        outcome.failed[rank] = str(error).splitlines()[0][:200]
    return True
