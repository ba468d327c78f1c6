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
def bench_ray(num_cpus: int) -> Iterator[None]:
    """The user's cluster when RAY_ADDRESS is set, else a fresh local Ray of our own; shut down after.

    `address="local"` matters: a plain `ray.init(num_cpus=...)` joins any cluster another
    process on this machine started with `ray start` (it is recorded in
    /tmp/ray/ray_current_cluster), and then refuses num_cpus.
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
        ray.init(address="local", num_cpus=num_cpus, num_gpus=0, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()
