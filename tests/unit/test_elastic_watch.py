"""watch_step against in-process answers: what makes a rank lost, and how soon."""

from __future__ import annotations

import time

from ray.exceptions import RayActorError

from baige_ray.elastic.watch import WatchTimes, watch_step
from baige_ray.elastic.workers import Worker
from tests.fake_pool import Answered, Later


class StepActor:
    """A worker whose step answers as `step` says and whose heartbeats answer as `heartbeat` says."""

    def __init__(self, step, heartbeat):
        self.aborted = False
        self.elastic_step = _Remote(lambda: step(self))
        self.heartbeat = _Remote(heartbeat)
        self.abort_step = _Remote(self._abort)

    def _abort(self):
        self.aborted = True
        return Answered(None)


class _Remote:
    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args, **kwargs):
        return self.answer()


def never(actor):
    return Later(lambda: None)


def until_aborted(actor):
    """A survivor in the step's collective with the dead rank: it raises once the controller aborts it."""
    return Later(lambda: Answered(error=RuntimeError("aborted")) if actor.aborted else None)


def test_a_dead_rank_whose_step_call_stays_pending_is_lost_at_its_first_failed_heartbeat():
    """Ray may hold a dead actor's in-flight call while it waits for the cause of death (seconds; 90 s
    under load in CI): a heartbeat sent to the dead actor fails at once, and that is enough."""
    dead = StepActor(step=never, heartbeat=lambda: Answered(error=RayActorError()))
    survivor = StepActor(step=until_aborted, heartbeat=lambda: Answered({"step": 6}))
    workers = [Worker(actor=actor, name=f"w{rank}") for rank, actor in enumerate((survivor, dead))]
    refs = [actor.elastic_step.remote(6) for actor in (survivor, dead)]
    began = time.monotonic()
    outcome = watch_step(workers, refs, WatchTimes(deadline_s=60.0, heartbeat_interval_s=0.01,
                                                   heartbeat_timeout_s=30.0))
    assert time.monotonic() - began < 5.0
    assert list(outcome.lost) == [1] and outcome.lost[1].startswith("actor died")
    assert list(outcome.failed) == [0] and not outcome.wedged  # let go at once, not at the deadline


def test_a_rank_whose_process_exited_is_lost_at_once_though_ray_and_its_heartbeats_say_nothing_yet():
    """The liveness connection closed (the kernel closes it with the process): that is enough, before Ray's
    death notice fails the call in flight or a heartbeat, and the survivors are let go."""
    dead = StepActor(step=never, heartbeat=lambda: Later(lambda: None))
    survivor = StepActor(step=until_aborted, heartbeat=lambda: Answered({"step": 6}))
    workers = [Worker(actor=actor, name=f"w{rank}") for rank, actor in enumerate((survivor, dead))]
    refs = [actor.elastic_step.remote(6) for actor in (survivor, dead)]
    began = time.monotonic()
    outcome = watch_step(workers, refs, WatchTimes(deadline_s=60.0, heartbeat_interval_s=1.0,
                                                   heartbeat_timeout_s=30.0),
                         exited=lambda asked: {w.name for w in asked if w.name == "w1"})
    assert time.monotonic() - began < 0.5
    assert outcome.lost == {1: "process exited (its connection to the controller closed)"}
    assert list(outcome.failed) == [0] and survivor.aborted
