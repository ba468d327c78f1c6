"""Busy device-seconds of a shared pool, sampled while the colocate benchmark replays its load.

A device is busy while training runs on it (whole or as a harvest rank beside a replica) or while
its replica computes a batch, and it counts once when both happen: a replica's compute on a device
that a running harvest rank already keeps busy adds nothing. The arithmetic is pure and unit-tested;
`PoolSampler` only collects the samples.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

Device = tuple[str, int]  # (node id, device index)


@dataclass(frozen=True)
class PoolSample:
    at: float
    training: bool  # the job is stepping (pauses to resize or recover are idle)
    whole: int  # training ranks on devices of their own
    shared: frozenset[Device] = frozenset()  # devices a harvest rank shares with a replica
    busy_s: dict[str, float] = field(default_factory=dict)  # each replica's compute seconds so far
    replica_devices: dict[str, Device] = field(default_factory=dict)
    step: int = 0


def busy_device_seconds(samples: Sequence[tuple[float, int]], start: float, end: float) -> float:
    """Integral over [start, end] of a piecewise-constant device count: each (time, devices) sample
    holds until the next one."""
    total = 0.0
    for (at, devices), (next_at, _) in zip(samples, [*samples[1:], (end, 0)]):
        total += devices * max(0.0, min(next_at, end) - max(at, start))
    return total


def train_device_seconds(samples: Sequence[PoolSample], start: float, end: float) -> float:
    """Device-seconds training ran on, whole devices and shared ones alike."""
    return busy_device_seconds([(s.at, s.whole + len(s.shared) if s.training else 0) for s in samples], start, end)


def infer_device_seconds(samples: Sequence[PoolSample]) -> float:
    """Replica compute seconds between the first and last sample, less those on a device a running
    harvest rank held (already counted busy for training)."""
    total = 0.0
    for before, after in zip(samples, samples[1:]):
        for replica, seconds in after.busy_s.items():
            gained = max(0.0, seconds - before.busy_s.get(replica, 0.0))
            overlapped = before.training and after.replica_devices.get(replica) in before.shared
            total += 0.0 if overlapped else gained
    return total


class PoolSampler:
    """Samples the job's state and the replicas' busy seconds on a thread, every `interval_s`."""

    def __init__(self, job, serve_info, interval_s: float = 0.25):
        self.job, self.serve_info, self.interval_s = job, serve_info, interval_s
        self.samples: list[PoolSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> PoolSample:
        from baige_ray.serving import busy_seconds, replica_devices

        status = self.job.status()
        shared = frozenset((w["node_id"], w["device_index"]) for w in status["workers"] if w.get("share", 1.0) < 1)
        return PoolSample(at=time.monotonic(), training=status["state"] == "running",
                          whole=status["num_workers"] - len(shared), shared=shared,
                          busy_s=busy_seconds(self.serve_info), replica_devices=replica_devices(self.serve_info),
                          step=status["step"])

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PoolSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
