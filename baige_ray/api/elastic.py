"""How elastic a training job is: its size bounds, spares, detection thresholds and snapshot cadence."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from baige_ray.api.validation import require_int, require_number


@dataclass(kw_only=True, frozen=True)
class ElasticConfig:
    """min/max_workers bound resizes (None: the job's num_workers); spares are warm actors outside the group.

    A step is hung when it runs longer than max(collective_timeout_floor_s,
    collective_timeout_factor x the median step time); the same bound is set as
    the collective timeout of every process group, so survivors blocked on a dead
    peer are released by then at the latest (engines whose collectives are
    abortable let go as soon as the controller sees the peer die). The defaults
    leave room for a shared, overloaded machine: a false alarm costs a recovery. A worker is a straggler when its compute time
    exceeds the median of its peers by straggler_threshold (1.5 = 50% slower) for
    straggler_patience steps in a row. Spares are kept at num_spares on free devices, except
    devices a resize just released: they stay free for released_device_hold_s, for whoever the
    job shrank for (a lend's serving replica) to start on.
    """

    min_workers: int | None = None
    max_workers: int | None = None
    num_spares: int = 0
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 2.0
    collective_timeout_floor_s: float = 1.0
    collective_timeout_factor: float = 10.0
    first_steps_timeout_s: float = 120.0
    straggler_threshold: float = 1.5
    straggler_patience: int = 5
    evict_stragglers: bool = True
    snapshot_every: int = 1
    # Sharded snapshots (FSDP2, ZeRO-3) keep the newest two in node shared memory (shelf.py). One halves
    # that memory, but a worker killed while copying (a fraction of a step) then leaves no whole snapshot
    # of its shards: recovery falls back to a replica or the persisted checkpoint.
    snapshot_slots: int = 2
    # Copies of the snapshot on two other nodes, every this many steps, for layouts where some
    # stage lives on one node only (0: never; a lost node then falls back to the persisted checkpoint).
    replicate_every: int = 1
    persist_every: int = 0
    persist_path: Path | None = None
    keep_checkpoints: int = 3
    max_recoveries: int = 10
    grow_check_interval_s: float = 1.0
    released_device_hold_s: float = 60.0
    peak_flops_per_device: float | None = None  # for the MFU estimate; None: MFU is not exported

    def __post_init__(self) -> None:
        for name in ("min_workers", "max_workers"):
            if getattr(self, name) is not None:
                require_int("ElasticConfig", name, getattr(self, name), minimum=1)
        if self.min_workers and self.max_workers and self.min_workers > self.max_workers:
            raise ValueError(
                f"ElasticConfig.min_workers={self.min_workers!r} is invalid: expected <= max_workers={self.max_workers}"
            )
        require_int("ElasticConfig", "num_spares", self.num_spares, minimum=0)
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_floor_s",
                     "first_steps_timeout_s", "grow_check_interval_s"):
            require_number("ElasticConfig", name, getattr(self, name), minimum=0, exclusive_minimum=True)
        require_number("ElasticConfig", "collective_timeout_factor", self.collective_timeout_factor, minimum=1)
        require_number("ElasticConfig", "straggler_threshold", self.straggler_threshold, minimum=1, exclusive_minimum=True)
        require_int("ElasticConfig", "straggler_patience", self.straggler_patience, minimum=1)
        require_int("ElasticConfig", "snapshot_every", self.snapshot_every, minimum=1)
        require_int("ElasticConfig", "snapshot_slots", self.snapshot_slots, minimum=1)
        if self.snapshot_slots > 2:
            raise ValueError(f"ElasticConfig.snapshot_slots={self.snapshot_slots!r} is invalid: expected 1 or 2")
        require_int("ElasticConfig", "replicate_every", self.replicate_every, minimum=0)
        require_int("ElasticConfig", "persist_every", self.persist_every, minimum=0)
        if self.persist_every and self.persist_path is None:
            raise ValueError("ElasticConfig.persist_path=None is invalid: expected a directory when persist_every > 0")
        if self.persist_path is not None:
            object.__setattr__(self, "persist_path", Path(self.persist_path).expanduser().resolve())
        require_int("ElasticConfig", "keep_checkpoints", self.keep_checkpoints, minimum=1)
        require_int("ElasticConfig", "max_recoveries", self.max_recoveries, minimum=0)
        require_number("ElasticConfig", "released_device_hold_s", self.released_device_hold_s, minimum=0)
        if self.peak_flops_per_device is not None:
            require_number("ElasticConfig", "peak_flops_per_device", self.peak_flops_per_device, minimum=0,
                           exclusive_minimum=True)

    def bounds(self, num_workers: int) -> tuple[int, int]:
        return self.min_workers or num_workers, self.max_workers or num_workers

    def step_deadline_s(self, median_step_s: float | None) -> float:
        if median_step_s is None:
            return self.first_steps_timeout_s
        return max(self.collective_timeout_floor_s, self.collective_timeout_factor * median_step_s)
