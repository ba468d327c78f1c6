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
def bench_ray(num_cpus: int, attempts: int = 3, env_vars: dict[str, str] | None = None) -> Iterator[None]:
    """The user's cluster when RAY_ADDRESS is set, else a fresh local Ray of our own; shut down after.

    `address="local"` matters: a plain `ray.init(num_cpus=...)` joins any cluster another
    process on this machine started with `ray start` (it is recorded in
    /tmp/ray/ray_current_cluster), and then refuses num_cpus. Ray gives a new node 30 s
    to register, which a heavily loaded machine can miss; starting is retried `attempts` times.
    `env_vars` go to every worker process of the session (a job-level runtime_env).
    """
    import logging

    import ray

    from baige_ray.constants import ray_address

    address = ray_address()
    runtime_env = {"env_vars": env_vars} if env_vars else None
    if ray.is_initialized():
        ray.shutdown()
    existing = _child_pids()
    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING, runtime_env=runtime_env)
    else:
        for attempt in range(1, attempts + 1):
            try:
                ray.init(address="local", num_cpus=num_cpus, num_gpus=0, logging_level=logging.WARNING,
                         runtime_env=runtime_env)
                break
            except Exception as error:  # Ray raises a bare Exception on a node start timeout
                ray.shutdown()
                _kill_children_except(existing)  # shutdown() misses the processes of a start that timed out
                if attempt == attempts or "timed out during startup" not in str(error):
                    raise
    try:
        yield
    finally:
        ray.shutdown()
        _wait_for_exit(_child_pids() - existing)  # the next system measured must not share the CPU with these


class HelperCpu:
    """Cores used, from now until `cores()`, by this process's descendants already running now.

    Started inside a local Ray session before a run, that is Ray's own processes (GCS, raylet,
    dashboard, agents, log monitor): the run's workers start later, and Ray's prestarted idle
    workers, which the run may turn into its actors, are left out.
    """

    def __init__(self) -> None:
        import time

        self._started = time.perf_counter()
        self._cpu_s = {pid: cpu for pid, (cpu, command) in _descendant_cpu().items()
                       if not command.startswith("ray::IDLE")}

    def cpu_s(self) -> float:
        """CPU seconds they have used since the watch began (those that exited since are not seen)."""
        now = _descendant_cpu()
        return sum(now[pid][0] - cpu for pid, cpu in self._cpu_s.items() if pid in now)

    def cores(self) -> float:
        import time

        used, elapsed = self.cpu_s(), time.perf_counter() - self._started
        return used / elapsed if elapsed > 0 else 0.0


def _descendant_cpu() -> dict[int, tuple[float, str]]:
    """pid -> (user + system CPU seconds, command line) of this process's descendants."""
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            with child.oneshot():
                times = child.cpu_times()
                found[child.pid] = (times.user + times.system, " ".join(child.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _wait_for_exit(pids: set[int], timeout_s: float = 30.0) -> None:
    import psutil

    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(processes, timeout=timeout_s)


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


def report_stage(args, stage: str, done: int, total: int) -> None:
    """Tell the progress line of `baige-ray bench` which stage a benchmark is in (nothing when a benchmark
    runs without the command, as in tests)."""
    progress = vars(args).get("progress")
    if progress is not None:
        progress(stage, done, total)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a benchmark's own Serve proxy or server)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
