"""The elastic controller's states and the transitions allowed between them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    PLANNING = "planning"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    FINISHED = "finished"
    FAILED = "failed"


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.PLANNING: frozenset({Phase.STARTING, Phase.RECOVERING, Phase.FAILED}),  # recovering: after a restart
    Phase.STARTING: frozenset({Phase.STARTING, Phase.RUNNING, Phase.RECOVERING, Phase.FAILED}),  # again: the first group failed
    Phase.RUNNING: frozenset({Phase.RUNNING, Phase.RECOVERING, Phase.RESIZING, Phase.FINISHED, Phase.FAILED}),
    Phase.RECOVERING: frozenset({Phase.RUNNING, Phase.RECOVERING, Phase.FAILED}),
    Phase.RESIZING: frozenset({Phase.RUNNING, Phase.RECOVERING, Phase.FAILED}),
    Phase.FINISHED: frozenset(),
    Phase.FAILED: frozenset(),
}
TERMINAL = frozenset({Phase.FINISHED, Phase.FAILED})


@dataclass(frozen=True)
class Transition:
    time: float
    source: Phase
    target: Phase
    reason: str


@dataclass
class StateMachine:
    phase: Phase = Phase.PLANNING
    history: list[Transition] = field(default_factory=list)

    def advance(self, target: Phase, reason: str = "") -> Transition:
        if target not in ALLOWED[self.phase]:
            raise RuntimeError(f"controller cannot go from {self.phase.value} to {target.value} ({reason})")
        transition = Transition(time.time(), self.phase, target, reason)
        if target is not self.phase:
            self.history.append(transition)
        self.phase = target
        return transition

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL
