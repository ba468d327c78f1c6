"""Helpers the training benchmarks share: steady-state statistics and a private local Ray session."""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def steady_median(values: Sequence[float], warmup: int) -> float:
    """Median of `values` after dropping the first `warmup` (allocator, first collectives, caches)."""
    if warmup < 0:
        raise ValueError(f"warmup={warmup} is invalid: expected >= 0")
    steady = list(values)[warmup:]
    if not steady:
        raise ValueError(f"no steady-state values: {len(values)} values, {warmup} warm-up")
    return statistics.median(steady)


def steady_throughput(tokens: Sequence[int], step_times_s: Sequence[float], warmup: int) -> float:
    """Tokens per second of a steady-state step: median tokens over median step time."""
    return steady_median(tokens, warmup) / steady_median(step_times_s, warmup)


@contextmanager
def bench_ray(num_cpus: int, attempts: int = 3) -> Iterator[None]:
    """The user's cluster when RAY_ADDRESS is set, else a fresh local Ray of our own; shut down after.

    `address="local"` matters: a plain `ray.init(num_cpus=...)` joins any cluster another
    process on this machine started with `ray start` (it is recorded in
    /tmp/ray/ray_current_cluster), and then refuses num_cpus. Ray gives a new node 30 s
    to register, which a heavily loaded machine can miss; starting is retried `attempts` times.
    """
    import logging

    import ray

    from baige_ray.constants import ray_address

    address = ray_address()
    if ray.is_initialized():
        ray.shutdown()
    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        for attempt in range(1, attempts + 1):
            before = _child_pids()
            try:
                ray.init(address="local", num_cpus=num_cpus, num_gpus=0, logging_level=logging.WARNING)
                break
            except Exception as error:  # Ray raises a bare Exception on a node start timeout
                ray.shutdown()
                _kill_children_except(before)  # shutdown() misses the processes of a start that timed out
                if attempt == attempts or "timed out during startup" not in str(error):
                    raise
    try:
        yield
    finally:
        ray.shutdown()


def _child_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _kill_children_except(keep: set[int]) -> None:
    """Kill this process's descendants that were not there before (only processes this process started)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        if child.pid not in keep:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
