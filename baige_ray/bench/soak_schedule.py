"""The soak's faults: a seeded schedule (pure) and what each kind does to a live process (signals).

The kinds (soak_faults.py carries them out): a worker SIGKILLed, a worker frozen with SIGSTOP (wedged:
it answers nothing), a straggler (SIGSTOP / SIGCONT in turns, so it runs a share of the time, as a
throttled chip does), a serving replica SIGKILLed, the job's controller SIGKILLed, the pool arbiter
SIGKILLed, a node lost and returned, a persisted checkpoint corrupted while every worker dies, the
checkpoints' disk full for a while. Kinds come
round in a seeded order, so a soak of a few minutes meets each of them once and a longer one several
times.

The load beside them (`spiky_rates`) is a base rate with seeded spikes, each one segment long, that the
served replicas cannot absorb alone: the arbiter has to lend training's devices to serving, then take
them back when the spike has passed.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass

FAULT_KINDS = ("worker_kill", "worker_freeze", "straggler", "replica_kill", "controller_kill", "arbiter_kill",
               "node_loss", "checkpoint_corrupt", "checkpoint_disk_full")


@dataclass(frozen=True)
class ScheduledFault:
    at_s: float  # seconds after the soak's start
    kind: str
    pick: int  # which target among the live ones, modulo their number when it fires


def fault_schedule(duration_s: float, seed: int, *, first_s: float = 20.0, gap_s: tuple[float, float] = (25.0, 40.0),
                   quiet_end_s: float = 20.0) -> list[ScheduledFault]:
    """Faults from `first_s` on, `gap_s` apart (uniform), none in the last `quiet_end_s` (the last one's
    recovery must fit); kinds in rounds, each round a seeded shuffle of every kind. A soak too short for one
    round at those gaps has them shortened in proportion, so that it still meets every kind once."""
    if duration_s <= 0 or first_s < 0 or not 0 < gap_s[0] <= gap_s[1] or quiet_end_s < 0:
        raise ValueError(f"invalid fault schedule: duration_s={duration_s}, first_s={first_s}, gap_s={gap_s}, "
                         f"quiet_end_s={quiet_end_s}")
    window = duration_s - quiet_end_s - first_s
    scale = min(1.0, max(0.0, window) / ((len(FAULT_KINDS) - 1) * gap_s[1]))
    shortest, longest = gap_s[0] * scale, gap_s[1] * scale
    rng = random.Random(seed)
    faults, at, kinds = [], first_s, []
    while at <= duration_s - quiet_end_s:
        if not kinds:
            kinds = rng.sample(FAULT_KINDS, len(FAULT_KINDS))
        faults.append(ScheduledFault(at_s=round(at, 3), kind=kinds.pop(0), pick=rng.randrange(1 << 16)))
        if longest <= 0:
            break
        at += rng.uniform(shortest, longest)
    return faults


def spiky_rates(duration_s: float, base_rate: float, spike_rate: float, seed: int, *, segment_s: float = 20.0,
                spike_every: int = 4) -> list[float]:
    """Requests/s for each `segment_s` of the soak: `spike_rate` in one segment of every `spike_every`
    (which one, seeded; never the first, so the arbiter measures the base load first), `base_rate` in
    the others."""
    if duration_s <= 0 or not 0 < base_rate <= spike_rate or segment_s <= 0 or spike_every < 2:
        raise ValueError(f"invalid load: duration_s={duration_s}, base_rate={base_rate}, spike_rate={spike_rate}, "
                         f"segment_s={segment_s}, spike_every={spike_every}")
    offset = random.Random(seed).randrange(1, spike_every)
    segments = max(1, round(duration_s / segment_s))
    return [spike_rate if segment % spike_every == offset else base_rate for segment in range(segments)]


class Throttle:
    """A process stopped `stopped_s` out of every `period_s` (SIGSTOP then SIGCONT) until `stop()` or
    until it is gone (`gone_at`: when it was found gone, wall clock); it is left running."""

    # Short turns: a throttled chip is slow in every step; steps here take about 0.1 s, and a 0.25 s period
    # left whole steps at full speed, so the straggler policy's "5 slow steps in a row" never held.
    def __init__(self, pid: int, *, stopped_s: float = 0.03, period_s: float = 0.05, limit_s: float = 60.0):
        self.pid, self.stopped_s, self.period_s, self.limit_s = pid, stopped_s, period_s, limit_s
        self.gone_at: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit_s
        try:
            while not self._done.is_set() and time.monotonic() < deadline:
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.stopped_s)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.period_s - self.stopped_s)
        except ProcessLookupError:
            self.gone_at = time.time()  # evicted by its job, or killed by another fault: nothing left to throttle
            return
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
