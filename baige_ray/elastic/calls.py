"""Waiting for what the controller asked its workers, whatever carries the answers.

In a job, workers are Ray actors and an answer is a `ray.ObjectRef`. The controller's unit tests run
it against an in-process pool (tests/fake_pool.py) whose answers are `Answer`s: objects that say
whether they are in and then give their value or raise. Both fail the same way: a dead worker raises
`RayActorError`, an answer not in by the timeout `GetTimeoutError`.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

import ray
from ray.exceptions import GetTimeoutError

POLL_S = 0.002  # how often in-process answers are looked at while waiting


@runtime_checkable
class Answer(Protocol):
    def ready(self) -> bool: ...

    def value(self) -> Any:
        """The answer, or the exception the call raised (a dead worker: RayActorError)."""


def is_answer(item: Any) -> bool:
    """Whether `item` is an answer still to be fetched (a Ray object ref or an in-process answer)."""
    return isinstance(item, (ray.ObjectRef, Answer))


def wait(refs: list, *, num_returns: int | None = None, timeout: float | None = None,
         fetch_local: bool = True) -> tuple[list, list]:
    """`ray.wait` over `refs`: (ready, not ready) once `num_returns` (default 1) are in, or at the timeout."""
    num_returns = 1 if num_returns is None else num_returns
    if not refs:
        return [], []
    if all(isinstance(ref, ray.ObjectRef) for ref in refs):
        return ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ready = [ref for ref in refs if ref.ready()]
        if len(ready) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
            return ready[:num_returns], [ref for ref in refs if ref not in ready[:num_returns]]
        time.sleep(POLL_S)


def get(ref_or_refs: Any, *, timeout: float | None = None) -> Any:
    """`ray.get` of one answer or a list of them."""
    many = isinstance(ref_or_refs, list)
    refs = ref_or_refs if many else [ref_or_refs]
    if not refs:
        return []
    if all(isinstance(ref, ray.ObjectRef) for ref in refs):
        return ray.get(ref_or_refs, timeout=timeout)
    _, pending = wait(refs, num_returns=len(refs), timeout=timeout)
    if pending:
        raise GetTimeoutError(f"{len(pending)} of {len(refs)} answers not in after {timeout}s")
    values = [ref.value() for ref in refs]
    return values if many else values[0]
