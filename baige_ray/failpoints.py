"""Named places inside a step where a fault plan can kill this process (fail points).

A crash at a step's start tests recovery, but not every fault lands there: a rollout engine dies while it
decodes, a trainer while its gradients are half reduced. A worker arms a point before its step
(`FaultPlan.crash(rank, step, at=...)`), the code passes the point with `fail_point`, and the first pass kills
the process with SIGKILL, as the kernel's OOM killer would. The worker disarms what its step did not reach.
When nothing is armed, `fail_point` is one set lookup.
"""

from __future__ import annotations

import os
import signal

SAMPLING = "sampling"  # after each decode step of the built-in engine: some tokens sampled, not all
BACKWARD = "backward"  # before a micro-batch's backward in the torch and DeepSpeed engines (not pipelines)
FAIL_POINTS = (SAMPLING, BACKWARD)

_armed: set[str] = set()


def arm_fail_point(name: str) -> None:
    """Kill this process the next time the code reaches `name`."""
    if name not in FAIL_POINTS:
        raise ValueError(f"fail point {name!r} is unknown: expected one of {', '.join(FAIL_POINTS)}")
    _armed.add(name)


def fail_point(name: str) -> None:
    if name in _armed:
        os.kill(os.getpid(), signal.SIGKILL)


def disarm_fail_points() -> list[str]:
    """Disarm every point; returns those armed and never reached."""
    missed = sorted(_armed)
    _armed.clear()
    return missed
