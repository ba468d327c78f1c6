"""Requests from the controller's control thread to its loop, as typed commands.

The control thread (status, resize, harvest, stop: called by users and the pool arbiter) never
writes the loop's state. It submits a command and waits on the command's own future; the loop takes
commands at a step boundary, acts, and answers each one. So each piece of the controller's state
has one writer, the loop, and nothing is polled.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Union

from baige_ray.elastic.workers import Worker


@dataclass(frozen=True)
class Resize:
    """Train on `num_workers` whole devices; answered with the whole workers training once it does."""

    num_workers: int
    reason: str = ""


@dataclass(frozen=True)
class Harvest:
    """Train with `wanted` ranks beside Serve replicas; `incoming` were started for it (and are stopped
    if the job ends first). Answered with the harvest ranks training (0 gives every device back)."""

    wanted: int
    incoming: tuple[Worker, ...] = field(default=())
    reason: str = ""


@dataclass(frozen=True)
class Stop:
    """Finish after the step in progress."""


@dataclass(frozen=True)
class AllowSteps:
    """Run the steps below `until` (a job launched with `steps_allowed` waits at that bound: a policy
    trainer opens each step once its rollouts are published). Answered with the bound in force."""

    until: int


Command = Union[Resize, Harvest, Stop, AllowSteps]


class JobOver(RuntimeError):
    """The loop has ended: a command submitted now is never carried out."""


@dataclass
class Pending:
    command: Command
    answer: Future = field(default_factory=Future)


class CommandQueue:
    """Thread-safe FIFO of commands; `closed` once the loop ends, after which submissions are refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._pending: deque[Pending] = deque()
        self._closed: str | None = None

    def submit(self, command: Command) -> Future:
        pending = Pending(command)
        with self._lock:
            if self._closed is not None:
                pending.answer.set_exception(JobOver(f"the job is over ({self._closed})"))
            else:
                self._pending.append(pending)
                self._arrived.notify_all()
        return pending.answer

    def wait(self, timeout_s: float) -> bool:
        """Block until a command is pending or `timeout_s` passes; whether one is."""
        with self._lock:
            return self._arrived.wait_for(lambda: bool(self._pending), timeout=timeout_s)

    def take(self) -> Pending | None:
        with self._lock:
            return self._pending.popleft() if self._pending else None

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def close(self, why: str) -> list[Pending]:
        """Refuse further commands; returns those never taken, for the loop to answer."""
        with self._lock:
            self._closed = why
            left, self._pending = list(self._pending), deque()
        return left
