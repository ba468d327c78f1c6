"""The controller's wait for trailing replicas (elastic/replica_copies.py) against in-process answers: it
ends at the copy, at its timeout, or as soon as the step in flight fails, not when that step succeeds."""

from __future__ import annotations

import time

from ray.exceptions import RayActorError

from baige_ray.elastic.replica_copies import HolderCopy, ReplicaCopies
from tests.fake_pool import Answered, Later


class _Holder:
    """A worker whose replica copy is still running."""

    def __init__(self, copy_answer):
        self.name, self.actor, self._answer = "holder", self, copy_answer
        self.copy_replica = self

    def remote(self, *args):
        return self._answer


def _copies(copy_answer) -> ReplicaCopies:
    copies = ReplicaCopies()
    holder = _Holder(copy_answer)
    copies._copies = {holder.name: HolderCopy(holder, in_flight=copy_answer, step=3)}
    return copies


def _after(seconds: float, answer: Answered) -> Later:
    due = time.monotonic() + seconds
    return Later(lambda: answer if time.monotonic() >= due else None)


def test_a_failed_step_in_flight_ends_the_wait_at_once():
    copies = _copies(Later(lambda: None))  # a copy that never ends
    step = [Answered({"loss": 1.0}), _after(0.05, Answered(error=RayActorError()))]
    began = time.monotonic()
    assert copies.wait_for(floor=4, timeout_s=5.0, watched=step) is False
    assert time.monotonic() - began < 1.0


def test_a_step_that_succeeds_meanwhile_does_not_end_the_wait():
    copies = _copies(_after(0.2, Answered(4)))
    assert copies.wait_for(floor=4, timeout_s=5.0, watched=[Answered({"loss": 1.0})]) is True


def test_without_a_step_in_flight_the_wait_ends_at_its_timeout():
    copies = _copies(Later(lambda: None))
    began = time.monotonic()
    assert copies.wait_for(floor=4, timeout_s=0.1) is False
    assert 0.09 < time.monotonic() - began < 1.0
