"""A discrete-event simulation of a long training run under faults: effective training time ratio (ETTR).

Pure arithmetic, no Ray. Faults arrive as a Poisson process at published per-device rates
(`FaultClass`); each costs what a recovery strategy says it costs (`Recovery`): the time to
notice it, to get training going again, and the work done since the state it resumes from.
Two strategies are priced on the same fault trace:

  * `ElasticRecovery` (baige-ray): warm spares take a lost worker's place, the process groups
    re-form in the surviving workers, state comes from in-memory snapshots (the rank's own host
    for a process fault, a peer node's copy when the host is gone), so at most the step in
    progress is redone. No spare node left: training goes on without the lost node's data-parallel
    replicas until one is repaired, then regroups to grow back. Persisted checkpoints are written
    beside training and are needed only for corruption, or when a peer holding the only copy of
    a lost node's state fails before the copy is re-made.
  * `RestartRecovery` (the Ray Train and torchrun way): a synchronous checkpoint to storage every
    `checkpoint_interval_s`; any fault stops the whole job, which restarts on a full set of nodes
    (waiting for a repair if no spare is left) and resumes from the last checkpoint.

ETTR = work kept / wall time, where work is measured in seconds of the full-size job's training.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

SCOPES = ("process", "device", "host", "corruption")


@dataclasses.dataclass(kw_only=True, frozen=True)
class FaultClass:
    """One kind of fault: its rate per device-hour, what it takes away (`SCOPES`), whether it hangs."""

    name: str
    per_device_hour: float
    scope: str
    hangs: bool = False

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"FaultClass.scope={self.scope!r} is invalid: expected one of {', '.join(SCOPES)}")
        if not self.per_device_hour >= 0:
            raise ValueError(f"FaultClass.per_device_hour={self.per_device_hour!r} is invalid: expected >= 0")

    @property
    def takes_node(self) -> bool:
        return self.scope in ("device", "host")


@dataclasses.dataclass(kw_only=True, frozen=True)
class Job:
    """The training job at one size: devices, how they group, a step's time and a device's state."""

    devices: int
    devices_per_node: int
    replica_devices: int  # devices one data-parallel replica spans (tp * pp)
    step_s: float
    state_bytes: float  # per device: what a replacement must restore (weights and optimizer state)

    def __post_init__(self) -> None:
        for name in ("devices", "devices_per_node", "replica_devices"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Job.{name}={getattr(self, name)!r} is invalid: expected >= 1")
        if self.devices % self.devices_per_node:
            raise ValueError(f"Job.devices={self.devices} is invalid: expected a multiple of "
                             f"devices_per_node={self.devices_per_node}")
        if not self.step_s > 0 or not self.state_bytes >= 0:
            raise ValueError(f"Job.step_s={self.step_s!r} and Job.state_bytes={self.state_bytes!r} are invalid: "
                             f"expected a positive step and non-negative state")

    @property
    def nodes(self) -> int:
        return self.devices // self.devices_per_node

    def replicas_lost_with_a_node(self) -> int:
        """Data-parallel replicas that lose a device when one node goes (a replica spans whole nodes or
        packs into one)."""
        return max(1, self.devices_per_node // self.replica_devices)

    @property
    def replicas(self) -> int:
        return max(1, self.devices // self.replica_devices)


@dataclasses.dataclass(kw_only=True, frozen=True)
class Fault:
    at_s: float
    kind: FaultClass


@dataclasses.dataclass(kw_only=True, frozen=True)
class Recovered:
    """What one fault cost: seconds of wall time with no training, and seconds of training redone."""

    down_s: float
    redone_s: float
    persisted: bool = False  # resumed from a persisted checkpoint


class Recovery:
    """A recovery strategy: what a fault costs the job, and how the strategy persists, stalls and shrinks."""

    name = "recovery"

    def recover(self, fault: Fault, job: Job, *, since_persisted_s: float, rng: np.random.Generator,
                peer_lost: bool) -> Recovered:
        raise NotImplementedError

    def persist_interval_s(self) -> float:
        raise NotImplementedError

    def persist_stall_s(self, job: Job) -> float:
        """Wall time training stops for one persisted checkpoint."""
        raise NotImplementedError

    def waits_for_full_size(self) -> bool:
        """Whether training stops until a node is back when no spare is left (else it runs smaller)."""
        raise NotImplementedError

    def regrow_s(self) -> float:
        """Wall time a job running smaller stops to take a repaired node back."""
        return 0.0

    def recopy_s(self, job: Job) -> float:
        """After a node is replaced, how long its state has a single copy (the peer's) left."""
        return 0.0

    def snapshot_stall_fraction(self) -> float:
        """Share of training time in-memory snapshots stall it."""
        return 0.0


@dataclasses.dataclass(kw_only=True, frozen=True)
class ElasticRecovery(Recovery):
    """baige-ray's recovery, from measured phases scaled to the job (bench/ettr.py says which are measured)."""

    detect_crash_s: float
    detect_hang_s: float
    regroup_s: float  # at the job's size
    local_restore_bytes_per_s: float  # a rank restoring its own host's snapshot
    peer_restore_bytes_per_s: float  # a replacement pulling a peer node's copy
    storage_read_bytes_per_s: float  # per device, from the persisted checkpoint
    persist_every_s: float
    stall_fraction: float  # of training time, what asynchronous snapshots and persistence take
    corruption_detect_s: float
    name: str = "baige-ray"

    def recover(self, fault: Fault, job: Job, *, since_persisted_s: float, rng: np.random.Generator,
                peer_lost: bool) -> Recovered:
        detect = self.detect_hang_s if fault.kind.hangs else self.detect_crash_s
        in_step = float(rng.uniform(0.0, job.step_s))  # the step in progress is redone
        if fault.kind.scope == "corruption" or peer_lost:
            restore = job.state_bytes / self.storage_read_bytes_per_s
            lag = self.corruption_detect_s if fault.kind.scope == "corruption" else 0.0
            return Recovered(down_s=detect + lag + self.regroup_s + restore, redone_s=since_persisted_s + lag,
                             persisted=True)
        rate = self.local_restore_bytes_per_s if fault.kind.scope == "process" else self.peer_restore_bytes_per_s
        return Recovered(down_s=detect + self.regroup_s + job.state_bytes / rate, redone_s=in_step)

    def persist_interval_s(self) -> float:
        return self.persist_every_s

    def persist_stall_s(self, job: Job) -> float:
        return 0.0  # written beside training; its cost is in stall_fraction

    def waits_for_full_size(self) -> bool:
        return False

    def regrow_s(self) -> float:
        return self.regroup_s

    def recopy_s(self, job: Job) -> float:
        return job.state_bytes / self.peer_restore_bytes_per_s

    def snapshot_stall_fraction(self) -> float:
        return self.stall_fraction


@dataclasses.dataclass(kw_only=True, frozen=True)
class RestartRecovery(Recovery):
    """Stop everything, restart the job, resume from the last synchronous checkpoint."""

    detect_crash_s: float
    hang_timeout_s: float
    restart_s: float  # processes started again, groups formed, at the job's size (checkpoint load apart)
    storage_read_bytes_per_s: float
    storage_write_bytes_per_s: float
    checkpoint_interval_s: float
    corruption_detect_s: float
    name: str = "restart"

    def recover(self, fault: Fault, job: Job, *, since_persisted_s: float, rng: np.random.Generator,
                peer_lost: bool) -> Recovered:
        detect = self.hang_timeout_s if fault.kind.hangs else self.detect_crash_s
        lag = self.corruption_detect_s if fault.kind.scope == "corruption" else 0.0
        restore = job.state_bytes / self.storage_read_bytes_per_s
        return Recovered(down_s=detect + lag + self.restart_s + restore, redone_s=since_persisted_s + lag,
                         persisted=True)

    def persist_interval_s(self) -> float:
        return self.checkpoint_interval_s

    def persist_stall_s(self, job: Job) -> float:
        return job.state_bytes / self.storage_write_bytes_per_s

    def waits_for_full_size(self) -> bool:
        return True


@dataclasses.dataclass(kw_only=True)
class Outcome:
    """Where a simulated run's wall time went, in seconds (work in full-size-job seconds)."""

    strategy: str
    wall_s: float
    faults: int = 0
    by_scope: dict[str, int] = dataclasses.field(default_factory=dict)
    down_s: float = 0.0  # no training: noticing, restarting, restoring, waiting for nodes
    redone_s: float = 0.0  # training repeated after resuming from an earlier state
    persist_stall_s: float = 0.0
    shrunk_s: float = 0.0  # work not done while running without lost nodes' replicas
    snapshot_stall_s: float = 0.0
    persisted_restores: int = 0
    spares_exhausted: int = 0

    @property
    def ettr(self) -> float:
        lost = self.down_s + self.redone_s + self.persist_stall_s + self.shrunk_s + self.snapshot_stall_s
        return max(0.0, 1.0 - lost / self.wall_s)

    def as_dict(self) -> dict:
        row = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}
        row["ettr"] = round(self.ettr, 5)
        return row


def fault_trace(kinds: list[FaultClass], devices: int, hours: float, seed: int) -> list[Fault]:
    """Faults over `hours` on `devices`: Poisson arrivals at the kinds' summed rate, kinds in proportion."""
    rng = np.random.default_rng(seed)
    rates = np.array([k.per_device_hour * devices / 3600.0 for k in kinds])
    total = rates.sum()
    if total <= 0:
        return []
    count = rng.poisson(total * hours * 3600.0)
    times = np.sort(rng.uniform(0.0, hours * 3600.0, count))
    chosen = rng.choice(len(kinds), size=count, p=rates / total)
    return [Fault(at_s=float(t), kind=kinds[int(i)]) for t, i in zip(times, chosen)]


def simulate(strategy: Recovery, job: Job, trace: list[Fault], *, hours: float, spare_nodes: int,
             repair_s: float, seed: int = 0) -> Outcome:
    """Run `job` for `hours` of wall time under `trace`, recovering with `strategy`."""
    rng = np.random.default_rng(seed + 1)
    wall = hours * 3600.0
    out = Outcome(strategy=strategy.name, wall_s=wall)
    spares = spare_nodes
    repairs: list[float] = []  # times failed nodes come back to the spare pool
    missing = 0  # nodes lost with no spare to take their place, not yet repaired
    missing_since = 0.0
    busy_until = 0.0  # the end of the recovery under way
    last_persisted = 0.0  # the wall time of the progress the last persisted checkpoint holds
    exposed_until = -math.inf  # a lost node's state has one copy left until then
    interval = strategy.persist_interval_s()
    stall = strategy.persist_stall_s(job)

    def account_shrunk(until: float) -> None:
        nonlocal missing_since
        if missing:
            share = min(1.0, missing * job.replicas_lost_with_a_node() / job.replicas)
            out.shrunk_s += share * max(0.0, until - missing_since)
        missing_since = until

    def return_repaired(until: float) -> None:
        nonlocal spares, missing, busy_until
        while repairs and repairs[0] <= until:
            back = heapq.heappop(repairs)
            if missing:
                account_shrunk(back)
                missing -= 1
                out.down_s += strategy.regrow_s()
                busy_until = max(busy_until, back) + strategy.regrow_s()
            else:
                spares += 1

    for fault in trace:
        return_repaired(fault.at_s)
        start = max(fault.at_s, busy_until)
        out.faults += 1
        out.by_scope[fault.kind.scope] = out.by_scope.get(fault.kind.scope, 0) + 1
        waited = 0.0
        if fault.kind.takes_node:
            heapq.heappush(repairs, start + repair_s)
            if spares:
                spares -= 1
            else:
                out.spares_exhausted += 1
                if strategy.waits_for_full_size():  # the first node repaired comes back into this job
                    waited = max(0.0, heapq.heappop(repairs) - start)
                else:
                    account_shrunk(start)
                    missing += 1
        # A node's only other copy was on the peer this fault hit, before the copy was re-made.
        peer_lost = fault.kind.takes_node and start < exposed_until and rng.uniform() < 1.0 / max(1, job.nodes - 1)
        since_persisted = _since_persisted(start, last_persisted, interval)
        recovered = strategy.recover(fault, job, since_persisted_s=since_persisted, rng=rng, peer_lost=peer_lost)
        out.down_s += recovered.down_s + waited
        out.redone_s += recovered.redone_s
        out.persisted_restores += int(recovered.persisted)
        busy_until = start + waited + recovered.down_s
        if recovered.persisted:
            last_persisted = busy_until  # the restored state is where the next interval counts from
        if fault.kind.takes_node:
            exposed_until = busy_until + strategy.recopy_s(job)
    return_repaired(wall)
    account_shrunk(wall)
    running = max(0.0, wall - out.down_s)
    out.persist_stall_s = (running / interval) * stall if interval > 0 else 0.0
    out.snapshot_stall_s = strategy.snapshot_stall_fraction() * running
    return out


def _since_persisted(at: float, last_persisted: float, interval: float) -> float:
    """Training time since the last persisted checkpoint before `at` (one every `interval` from the last
    resume), which resuming from it repeats."""
    if interval <= 0:
        return at - last_persisted
    return (at - last_persisted) % interval
