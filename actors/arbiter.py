"""PoolArbiter: shares one device pool between a training job and a served model.

Every `poll_interval_s` the arbiter observes inference load (request rate, p99 latency, queue depth
as the replicas report them) and the pool (devices training and inference hold), asks the lending
policy, and acts:

- lend k: training shrinks by k devices (whole data-parallel replicas, global batch kept by
  gradient accumulation), the newest in-memory weights are published to serving, and Serve grows
  by k replicas, each asking for one device, so they land on the devices training released;
- reclaim k: Serve shrinks by k replicas (Serve drains them: no request dropped) and only once they
  are gone does training grow back onto the devices they held;
- harvest k / unharvest k (with `harvest_share` set): training starts k more ranks, each on
  `harvest_share` of a lightly loaded replica's device, or stops k of them. The replicas stay up
  and keep serving throughout: no request is moved, and giving a device back is one training regroup.

A disaggregated application (prefill and decode replicas) counts both sides' replicas as its
inference devices; a lend's replicas go to whichever side is busier, a reclaim's come from the
idler one, and while the arbiter holds, one replica at a time may move between the sides as their
queues shift (policies/disaggregation.py).

Once a backlog of requests has drained, the arbiter asks Serve's HTTP proxies to give back the memory it
left them (policies/memory_return.py): otherwise each stays as large as the largest backlog it has held.

A lend takes effect only once its replica is up, so the loop measures how long its own lends take
(smoothed over the lends so far, starting from `lend_latency_s`) and gives the policy a forecast of
the request rate that far ahead, from the trend of the rates it observed over `trend_window_s`.

`ArbiterLoop` holds the decision loop and talks to the two sides through small interfaces, so it
is tested without Ray; `JobTrainingSide` and the serving sides (serving_sides.py) are the real ones and
`PoolArbiter` the Ray actor that runs the loop on a thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from baige_ray.actors.serving_sides import serving_side
from baige_ray.api.validation import require_int, require_number
from baige_ray.elastic.workers import restarted_by_ray
from baige_ray.ops.events import EventLog
from baige_ray.policies.lending import (
    LendingAction,
    LendingDecision,
    LendingObservation,
    LendingPolicy,
    decide,
    forecast_rate,
)
from baige_ray.policies.memory_return import MemoryReturnPolicy, should_return_memory

MIN_REQUESTS_TO_MEASURE = 20
CAPACITY_SMOOTHING = 0.3
LEND_LATENCY_SMOOTHING = 0.5


class TrainingSide(Protocol):
    def num_devices(self) -> int: ...
    def is_running(self) -> bool: ...
    def resize(self, num_devices: int, reason: str) -> int: ...
    def latest_model_state(self) -> tuple[int, Any]: ...
    def num_harvested(self) -> int: ...
    def harvest(self, count: int, share: float, reason: str) -> int: ...


class ServingSide(Protocol):
    def num_replicas(self) -> int: ...
    def load(self, window_s: float) -> dict: ...
    def scale(self, num_replicas: int) -> None: ...
    def reload(self, step: int, state_ref: Any) -> None: ...
    def rebalance(self) -> str | None:
        """Re-split the replicas among roles by load; why it moved some, or None."""
    def return_idle_memory(self) -> int:
        """Have the HTTP proxies give back the free heap a drained backlog left them; bytes returned."""


@dataclass(kw_only=True, frozen=True)
class ArbiterConfig:
    slo_p99_s: float
    replica_capacity: float  # requests/s one replica sustains: the first estimate, refined from reports
    capacity_from_reports: bool = True
    min_train_devices: int = 1
    min_infer_devices: int = 1
    devices_per_train_replica: int = 1
    train_sizes: tuple[int, ...] | None = None  # sizes the job runs at (baige_ray.elastic.sizing.valid_sizes)
    poll_interval_s: float = 1.0
    load_window_s: float = 5.0
    refresh_weights_s: float | None = None  # also push training's newest weights to serving this often
    lend_latency_s: float = 15.0  # first guess of how long a lend takes, refined from the lends made
    trend_window_s: float | None = 30.0  # rate history the forecast fits; None: no forecast
    policy: LendingPolicy = field(default_factory=LendingPolicy)
    event_log: Path | None = None
    harvest_share: float | None = None  # of a serving device one training rank may use; None: no harvesting
    shared_capacity: float = 0.5  # what a shared device serves, as a fraction of replica_capacity
    memory_return: MemoryReturnPolicy | None = field(default_factory=MemoryReturnPolicy)  # None: never trim proxies

    def __post_init__(self) -> None:
        for name in ("slo_p99_s", "replica_capacity", "poll_interval_s", "load_window_s", "lend_latency_s"):
            require_number("ArbiterConfig", name, getattr(self, name), minimum=0, exclusive_minimum=True)
        for name in ("min_train_devices", "min_infer_devices", "devices_per_train_replica"):
            require_int("ArbiterConfig", name, getattr(self, name), minimum=1)
        if self.refresh_weights_s is not None:
            require_number("ArbiterConfig", "refresh_weights_s", self.refresh_weights_s, minimum=0, exclusive_minimum=True)
        if self.trend_window_s is not None:
            require_number("ArbiterConfig", "trend_window_s", self.trend_window_s, minimum=0, exclusive_minimum=True)
        require_number("ArbiterConfig", "shared_capacity", self.shared_capacity, minimum=0, exclusive_minimum=True,
                       maximum=1)
        if self.harvest_share is not None:
            require_number("ArbiterConfig", "harvest_share", self.harvest_share, minimum=0, exclusive_minimum=True,
                           maximum=0.99)
            if self.policy.harvest_below is None:
                raise ValueError("ArbiterConfig.harvest_share is set but policy.harvest_below is None: "
                                 "the policy would never harvest")


class ArbiterLoop:
    """One `tick` = observe, decide, act. Holds the pool's split between the two sides."""

    def __init__(self, training: TrainingSide, serving: ServingSide, config: ArbiterConfig, *,
                 events: EventLog | None = None, clock: Callable[[], float] = time.monotonic):
        self.training, self.serving, self.config, self.clock = training, serving, config, clock
        self.events = events or EventLog(config.event_log)
        self.train_devices = training.num_devices()
        self.infer_devices = serving.num_replicas()
        self.harvested = self._num_harvested()
        self.replica_capacity = config.replica_capacity
        self.lend_latency_s = config.lend_latency_s
        self._rates: deque[tuple[float, float]] = deque()  # (time the window is centred on, rate)
        self._last_change = -float("inf")
        self._last_refresh = clock()
        self._peak_depth = 0  # the deepest queue since the proxies last gave memory back
        self._last_memory_return = -float("inf")
        self.last_decision: LendingDecision | None = None
        self.last_load: dict = {}

    def observe(self) -> LendingObservation:
        load = self.serving.load(self.config.load_window_s)
        self.last_load = load
        self._peak_depth = max(self._peak_depth, int(load["queue_depth"]))
        self._refine_capacity(load)
        self.train_devices = self.training.num_devices()
        self.harvested = self._num_harvested()
        forecast = self._forecast(load["request_rate"])
        return LendingObservation(
            request_rate=load["request_rate"], p99_latency_s=load["p99_latency_s"], slo_p99_s=self.config.slo_p99_s,
            queue_depth=load["queue_depth"], train_devices=self.train_devices, infer_devices=self.infer_devices,
            min_train_devices=self.config.min_train_devices, replica_capacity=self.replica_capacity,
            seconds_since_change=max(0.0, self.clock() - self._last_change),
            devices_per_train_replica=self.config.devices_per_train_replica,
            min_infer_devices=self.config.min_infer_devices, train_sizes=self.config.train_sizes,
            forecast_rate=forecast, harvested_devices=min(self.harvested, self.infer_devices),
            shared_capacity=self.config.shared_capacity,
        )

    def _num_harvested(self) -> int:
        return self.training.num_harvested() if self.config.harvest_share is not None else 0

    def _forecast(self, rate: float) -> float | None:
        """The rate expected once a lend decided now is serving: the load window's rate belongs to
        the middle of the window, and a lend's replica serves `lend_latency_s` plus a poll from now."""
        if self.config.trend_window_s is None:
            return None
        now = self.clock()
        self._rates.append((now - self.config.load_window_s / 2, rate))
        while self._rates and self._rates[0][0] < now - self.config.trend_window_s:
            self._rates.popleft()
        return forecast_rate(list(self._rates), now + self.lend_latency_s + self.config.poll_interval_s,
                             min_span_s=self.config.trend_window_s / 3)

    def _refine_capacity(self, load: dict) -> None:
        """Requests served per second of replica compute, smoothed: utilization then tracks how busy
        the replicas really are (slower when they share cores with training, faster as batches fill)."""
        measured = load.get("requests_per_busy_s")
        if self.config.capacity_from_reports and measured and load.get("num_requests", 0) >= MIN_REQUESTS_TO_MEASURE:
            self.replica_capacity = (1 - CAPACITY_SMOOTHING) * self.replica_capacity + CAPACITY_SMOOTHING * measured

    def tick(self) -> LendingDecision:
        if not self.training.is_running():
            self.last_decision = LendingDecision(LendingAction.HOLD, 0, "training is not running")
            return self.last_decision
        observation = self.observe()
        decision = decide(observation, self.config.policy)
        self.last_decision = decision
        if decision.action is LendingAction.LEND:
            self._lend(decision, observation)
        elif decision.action is LendingAction.RECLAIM:
            self._reclaim(decision, observation)
        elif decision.action in (LendingAction.HARVEST, LendingAction.UNHARVEST):
            self._harvest(decision, observation)
        else:
            self._maybe_refresh_weights()
            self._rebalance()
            self._maybe_return_memory(observation.queue_depth)
        return decision

    def _lend(self, decision: LendingDecision, observation: LendingObservation) -> None:
        started = self.clock()
        target = self.train_devices - decision.num_devices
        self.train_devices = self.training.resize(target, f"lend {decision.num_devices} to inference")
        freed = observation.train_devices - self.train_devices
        if freed > 0:
            self._publish_weights()
            # One replica at a time: on hosts where starting one is CPU-heavy, starting them together
            # slowed the running replicas past the objective, and the first one up relieves them sooner.
            for _ in range(freed):
                self.serving.scale(self.infer_devices + 1)
                self.infer_devices += 1
            took = self.clock() - started
            self.lend_latency_s = (1 - LEND_LATENCY_SMOOTHING) * self.lend_latency_s + LEND_LATENCY_SMOOTHING * took
        self._record("lend", decision, observation, freed, started)

    def _reclaim(self, decision: LendingDecision, observation: LendingObservation) -> None:
        started = self.clock()
        self.serving.scale(self.infer_devices - decision.num_devices)
        self.infer_devices -= decision.num_devices
        target = self.train_devices + decision.num_devices
        self.train_devices = self.training.resize(target, f"reclaim {decision.num_devices} from inference")
        self._record("reclaim", decision, observation, decision.num_devices, started)

    def _harvest(self, decision: LendingDecision, observation: LendingObservation) -> None:
        started = self.clock()
        sign = 1 if decision.action is LendingAction.HARVEST else -1
        wanted = self.harvested + sign * decision.num_devices
        self.harvested = self.training.harvest(wanted, self.config.harvest_share, decision.reason)
        self._record(decision.action.value, decision, observation, decision.num_devices, started)

    def _rebalance(self) -> None:
        started = self.clock()
        moved = self.serving.rebalance()
        if moved is not None:
            self.events.record("rebalance", moved, train_devices=self.train_devices, infer_devices=self.infer_devices,
                               took_s=round(self.clock() - started, 3))

    def _maybe_return_memory(self, queue_depth: int) -> None:
        policy = self.config.memory_return
        since = self.clock() - self._last_memory_return
        if policy is None or not should_return_memory(self._peak_depth, queue_depth, since, policy):
            return
        started, peak = self.clock(), self._peak_depth
        self._last_memory_return, self._peak_depth = started, queue_depth  # a failed return waits its interval too
        returned = self.serving.return_idle_memory()
        self.events.record("memory_return", f"a backlog of {peak} requests drained",
                           returned_mib=round(returned / (1 << 20), 1), took_s=round(self.clock() - started, 3))

    def _publish_weights(self) -> None:
        step, state_ref = self.training.latest_model_state()
        self.serving.reload(step, state_ref)
        self._last_refresh = self.clock()

    def _maybe_refresh_weights(self) -> None:
        every = self.config.refresh_weights_s
        if every is not None and self.clock() - self._last_refresh >= every:
            self._publish_weights()

    def _record(self, kind: str, decision: LendingDecision, observation: LendingObservation,
                moved: int, started: float) -> None:
        self._last_change = self.clock()
        self.events.record(
            kind, decision.reason, train_devices=self.train_devices, infer_devices=self.infer_devices,
            harvested_devices=self.harvested, num_devices=moved, took_s=round(self._last_change - started, 3),
            request_rate=round(observation.request_rate, 3), p99_latency_s=round(observation.p99_latency_s, 4),
            forecast_rate=None if observation.forecast_rate is None else round(observation.forecast_rate, 3),
            lend_latency_s=round(self.lend_latency_s, 2),
        )

    def status(self) -> dict:
        decision = self.last_decision
        return {
            "train_devices": self.train_devices,
            "infer_devices": self.infer_devices,
            "harvested_devices": self.harvested,
            "replica_capacity": self.replica_capacity,
            "lend_latency_s": self.lend_latency_s,
            "last_decision": None if decision is None else
            {"action": decision.action.value, "num_devices": decision.num_devices, "reason": decision.reason},
            "load": self.last_load,
            "events": self.events.recent(20),
        }


class JobTrainingSide:
    """The training side, through the elastic controller actor of a launched job."""

    def __init__(self, job_name: str):
        import ray

        self._ray = ray
        self._controller = ray.get_actor(f"baige-controller:{job_name}", namespace="baige")

    def _status(self) -> dict:
        return self._ray.get(self._controller.status.remote())

    def num_devices(self) -> int:
        status = self._status()
        return int(status["num_workers"]) - int(status.get("num_harvest", 0))

    def num_harvested(self) -> int:
        return int(self._status().get("num_harvest", 0))

    def harvest(self, count: int, share: float, reason: str) -> int:
        return int(self._ray.get(self._controller.harvest.remote(count, share, reason)))

    def is_running(self) -> bool:
        return self._status()["state"] == "running"

    def resize(self, num_devices: int, reason: str) -> int:
        return int(self._ray.get(self._controller.resize.remote(num_devices, reason)))

    def latest_model_state(self) -> tuple[int, Any]:
        return self._ray.get(self._controller.latest_model_state.remote())


class ArbiterThread:
    """Runs an ArbiterLoop's ticks on a thread of its own. A tick that moves devices takes tens of seconds
    (training shrinks, a replica starts and loads the weights), so `status` reads the loop as it stands
    instead of waiting for the tick: a caller asking how many replicas serving holds gets an answer mid-move."""

    def __init__(self, loop: ArbiterLoop, after_tick: Callable[[], None] = lambda: None):
        self._loop, self._after_tick = loop, after_tick
        self._stop = threading.Event()
        self._errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="pool-arbiter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._loop.config.poll_interval_s):
            try:
                self._loop.tick()
            except Exception as error:  # keep arbitrating; the next tick re-observes the pool
                self._errors = (self._errors + [f"{type(error).__name__}: {error}"])[-10:]
            self._after_tick()

    def status(self) -> dict:
        return {**self._loop.status(), "errors": list(self._errors)}

    def stop(self) -> dict:
        """Stop deciding once the tick under way ends (the pool stays split as it is); the final status."""
        self._stop.set()
        self._thread.join()
        return self.status()


class PoolArbiter:
    """Ray actor running an ArbiterLoop on an ArbiterThread; create it with `start_pool_arbiter`."""

    def __init__(self, job_name: str, serve_info: Any, model_config: Any, config: ArbiterConfig):
        from baige_ray.ops.metrics import JobMetrics

        serving = serving_side(serve_info, model_config, config.min_infer_devices)
        loop = ArbiterLoop(JobTrainingSide(job_name), serving, config)
        if restarted_by_ray():  # what it measured (capacity, lend latency) died with it; the split is observed
            kind, reason = "arbiter_restart", ("Ray restarted the pool arbiter after its process died; "
                                       "it takes the split as it finds it")
        else:
            kind, reason = "start", "the pool arbiter takes the split as it finds it"
        loop.events.record(kind, reason, train_devices=loop.train_devices, infer_devices=loop.infer_devices,
                           pid=os.getpid())
        metrics = JobMetrics(job=job_name)
        self._thread = ArbiterThread(loop, lambda: metrics.devices(train=loop.train_devices,
                                                                   infer=loop.infer_devices))

    def status(self) -> dict:
        return {**self._thread.status(), "pid": os.getpid()}

    def stop(self) -> dict:
        """Stop deciding (the pool stays split as it is); returns the final status."""
        return {**self._thread.stop(), "pid": os.getpid()}


def start_pool_arbiter(job_name: str, serve_info: Any, model_config: Any, config: ArbiterConfig):
    """The PoolArbiter actor for a launched job and a served application (it starts polling at once).

    Ray restarts it if its process dies, on the head node like the controller, so a worker node's loss
    does not end the arbitration; `config.event_log` keeps its decisions across restarts."""
    import ray

    from baige_ray.topology.head import on_head_node

    return ray.remote(PoolArbiter).options(
        name=f"baige-arbiter:{job_name}", namespace="baige", num_cpus=0, max_concurrency=4, max_restarts=-1,
        scheduling_strategy=on_head_node(),
    ).remote(job_name, serve_info, model_config, config)
