"""The next step an elastic job will run, set on the controller's loop thread and waited for on its
control threads: a caller that needs step n done (an RL trainer before it refits) hears of it when it
happens instead of polling the job's status."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StepProgress:
    def __init__(self) -> None:
        self._next_step = 0
        self._changed = threading.Condition()

    @property
    def next_step(self) -> int:
        return self._next_step

    def set(self, next_step: int) -> None:
        with self._changed:
            self._next_step = next_step
            self._changed.notify_all()

    def wait_for(self, steps: int, timeout_s: float, *, ended: Callable[[], bool], recheck_s: float = 0.25) -> int:
        """The next step, once at least `steps` steps are done, `ended()` says the job is over (looked at
        every `recheck_s`: an ending moves no step), or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._next_step < steps and not ended() and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(min(left, recheck_s))
            return self._next_step
