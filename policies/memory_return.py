"""When to ask Serve's HTTP proxies to give back the heap a request backlog left them (pure, no Ray).

A proxy holding a backlog (requests queued at it for replicas at their `max_ongoing_requests`, each with its
connection) grows the allocator arenas of its threads. glibc keeps the freed pages after the backlog drains,
so without a trim the proxy stays as large as the largest backlog it has held (docs/benchmarks.md). Trimming
during the backlog returns little and the next requests take the pages again; the moment is once the
requests in flight, having reached `min_backlog`, have fallen to `idle_depth` or fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

from baige_ray.api.validation import require_int, require_number


@dataclass(kw_only=True, frozen=True)
class MemoryReturnPolicy:
    min_backlog: int = 32  # requests the replicas held at once: one replica full (serve()'s max_ongoing_requests)
    idle_depth: int = 2  # at most this many held: the backlog has drained
    min_interval_s: float = 10.0  # between two returns

    def __post_init__(self) -> None:
        require_int("MemoryReturnPolicy", "min_backlog", self.min_backlog, minimum=1)
        require_int("MemoryReturnPolicy", "idle_depth", self.idle_depth, minimum=0)
        require_number("MemoryReturnPolicy", "min_interval_s", self.min_interval_s, minimum=0)
        if self.idle_depth >= self.min_backlog:
            raise ValueError(f"MemoryReturnPolicy.idle_depth={self.idle_depth} is invalid: expected fewer "
                             f"than min_backlog={self.min_backlog}")


def should_return_memory(peak_depth: int, queue_depth: int, seconds_since_return: float,
                         policy: MemoryReturnPolicy) -> bool:
    """Whether to trim now: the deepest queue since the last return (`peak_depth`) was a backlog, the
    queue now (`queue_depth`) has drained, and the last return is `min_interval_s` old."""
    return (peak_depth >= policy.min_backlog and queue_depth <= policy.idle_depth
            and seconds_since_return >= policy.min_interval_s)
