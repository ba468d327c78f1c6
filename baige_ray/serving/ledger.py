"""Request accounting shared by a serving application's replicas (pure Python, no Ray).

Replicas report what they finished since their last report: request latencies, the seconds they
spent computing batches, and how many requests they hold right now. The ledger turns those
reports into the load figures the pool arbiter decides on (request rate, p99 latency, queue
depth over a recent window) and into busy device-seconds for utilization. The replicas of a
disaggregated application also report their role and their engine's queue, which size each side.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from baige_ray.policies.disaggregation import SideLoad

# A replica that has not reported for this long is gone (drained or dead): its queue no longer counts.
STALE_AFTER_S = 3.0


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (0 for no values): the smallest value with `fraction` of values at or below."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r} is invalid: expected 0 < fraction <= 1")
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


@dataclass(frozen=True)
class LoadWindow:
    """Load over the last `window_s` seconds."""

    window_s: float
    num_requests: int
    request_rate: float
    p99_latency_s: float
    queue_depth: int
    num_replicas: int
    busy_s: float  # seconds replicas spent computing batches in the window

    @property
    def requests_per_busy_s(self) -> float | None:
        """What a replica serves per second of compute at the current batch sizes (None: no data)."""
        return self.num_requests / self.busy_s if self.busy_s > 0 and self.num_requests else None


@dataclass(frozen=True)
class EngineLoad:
    role: str  # "colocated", "prefill" or "decode"
    num_waiting: int
    num_running: int


@dataclass
class _ReplicaRecord:
    last_report: float
    ongoing: int = 0
    busy_s: float = 0.0
    num_requests: int = 0
    engine: EngineLoad | None = None


@dataclass
class RequestLedger:
    keep_s: float = 120.0
    _latencies: deque = field(default_factory=deque)  # (finish time, latency seconds)
    _busy: deque = field(default_factory=deque)  # (report time, busy seconds)
    _replicas: dict[str, _ReplicaRecord] = field(default_factory=dict)

    def record(
        self, replica: str, now: float, latencies: Sequence[float], busy_s: float, ongoing: int,
        engine: EngineLoad | None = None,
    ) -> None:
        record = self._replicas.setdefault(replica, _ReplicaRecord(last_report=now))
        record.last_report = now
        record.ongoing = ongoing
        record.engine = engine
        record.busy_s += busy_s
        record.num_requests += len(latencies)
        self._latencies.extend((now, latency) for latency in latencies)
        self._busy.append((now, busy_s))
        for history in (self._latencies, self._busy):
            while history and history[0][0] < now - self.keep_s:
                history.popleft()

    def window(self, now: float, window_s: float) -> LoadWindow:
        recent = [latency for finished, latency in self._latencies if finished >= now - window_s]
        live = [r for r in self._replicas.values() if r.last_report >= now - STALE_AFTER_S]
        return LoadWindow(
            window_s=window_s,
            num_requests=len(recent),
            request_rate=len(recent) / window_s,
            p99_latency_s=percentile(recent, 0.99),
            queue_depth=sum(r.ongoing for r in live),
            num_replicas=len(live),
            busy_s=sum(busy for reported, busy in self._busy if reported >= now - window_s),
        )

    def side_loads(self, now: float) -> dict[str, SideLoad]:
        """Per role, the live replicas and their engines' queues as last reported."""
        engines = [r.engine for r in self._replicas.values() if r.last_report >= now - STALE_AFTER_S and r.engine]
        return {role: SideLoad(num_replicas=sum(1 for e in engines if e.role == role),
                               num_waiting=sum(e.num_waiting for e in engines if e.role == role),
                               num_running=sum(e.num_running for e in engines if e.role == role))
                for role in sorted({engine.role for engine in engines})}

    def live_replicas(self, now: float) -> list[str]:
        return [name for name, r in self._replicas.items() if r.last_report >= now - STALE_AFTER_S]

    def busy_seconds(self) -> dict[str, float]:
        return {replica: record.busy_s for replica, record in self._replicas.items()}

    def requests_served(self) -> int:
        return sum(record.num_requests for record in self._replicas.values())
