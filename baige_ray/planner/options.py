"""Knobs of the search; every default is a stated assumption of the cost model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from baige_ray.api.validation import require_int, require_number
from baige_ray.planner.calibration import Calibration
from baige_ray.planner.cost import CostConstants
from baige_ray.planner.mapping import MAPPINGS
from baige_ray.planner.memory import RECOMPUTE

# Ray's memory monitor kills a node's newest workers once the node uses more than this share of its memory
# (Ray's own default, unless RAY_memory_usage_threshold overrides it).
RAY_MEMORY_USAGE_THRESHOLD = 0.95
# Host memory a node keeps for processes other than the job's workers: on this project's 2-core, 24 GiB
# host Ray's daemons (raylet, GCS, dashboard and its agents) held 1.5 GB, the job's controller 0.4 GB.
HOST_MEMORY_RESERVE_GB = 2.0


def ray_memory_usage_threshold() -> float:
    value = os.environ.get("RAY_memory_usage_threshold", str(RAY_MEMORY_USAGE_THRESHOLD))
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"RAY_memory_usage_threshold={value!r} is invalid: expected a number in (0, 1]") from None


@dataclass(kw_only=True, frozen=True)
class PlanOptions:
    top_k: int = 5  # alternatives kept, each a distinct (tp, pp, dp, ep)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    mappings: tuple[str, ...] = MAPPINGS
    max_micro_batch: int = 64
    usable_memory_fraction: float = 0.9  # the rest: CUDA context, NCCL buffers, fragmentation
    # A node's host memory the job's workers may fill: the share Ray lets processes use, less a reserve.
    usable_host_memory_fraction: float = field(default_factory=ray_memory_usage_threshold)
    host_memory_reserve_gb: float = HOST_MEMORY_RESERVE_GB
    max_efficiency: float = CostConstants.max_efficiency
    machine_balance: float = CostConstants.machine_balance
    replan_tolerance: float = 0.05  # replan keeps ranks in place if within 5% of a fresh plan
    # ZeRO stages that may run beside EP > 1. baige-ray's engines run EP with DDP, FSDP2 or DeepSpeed
    # ZeRO-1/2; FSDP2 leaves experts unsharded over their data-parallel group, unlike the ZeRO-3 this
    # cost model prices, so plans for them (runtime/auto_plan.py) leave stage 3 out.
    expert_parallel_zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    max_pp: int | None = None  # the most pipeline stages the model can run in (None: one per layer)
    # ZeRO stages whose engines overlap gradient reductions with backward (CostConstants).
    overlapped_zero_stages: tuple[int, ...] = CostConstants.overlapped_zero_stages
    # Measured figures of this cluster (`baige-ray calibrate`); None prices with the nominal constants.
    calibration: Calibration | None = field(default=None, compare=False)
    constants: CostConstants = field(init=False)

    def __post_init__(self) -> None:
        require_int("PlanOptions", "top_k", self.top_k, minimum=0)
        require_int("PlanOptions", "max_micro_batch", self.max_micro_batch, minimum=1)
        if self.max_pp is not None:
            require_int("PlanOptions", "max_pp", self.max_pp, minimum=1)
        object.__setattr__(self, "overlapped_zero_stages", tuple(self.overlapped_zero_stages))
        bad = [v for v in self.overlapped_zero_stages if v not in (0, 1, 2, 3)]
        if bad:
            raise ValueError(f"PlanOptions.overlapped_zero_stages={list(self.overlapped_zero_stages)!r} is invalid: "
                             "expected a subset of [0, 1, 2, 3]")
        for name, values, allowed in (("zero_stages", self.zero_stages, (0, 1, 2, 3)),
                                      ("expert_parallel_zero_stages", self.expert_parallel_zero_stages, (0, 1, 2, 3)),
                                      ("recompute", self.recompute, RECOMPUTE), ("mappings", self.mappings, MAPPINGS)):
            object.__setattr__(self, name, tuple(values))
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ValueError(f"PlanOptions.{name}={list(values)!r} is invalid: expected a non-empty subset of "
                                 f"{list(allowed)}")
        require_number("PlanOptions", "usable_memory_fraction", self.usable_memory_fraction, minimum=0,
                       exclusive_minimum=True, maximum=1)
        require_number("PlanOptions", "usable_host_memory_fraction", self.usable_host_memory_fraction, minimum=0,
                       exclusive_minimum=True, maximum=1)
        require_number("PlanOptions", "host_memory_reserve_gb", self.host_memory_reserve_gb, minimum=0)
        require_number("PlanOptions", "max_efficiency", self.max_efficiency, minimum=0, exclusive_minimum=True,
                       maximum=1)
        require_number("PlanOptions", "machine_balance", self.machine_balance, minimum=0, exclusive_minimum=True)
        require_number("PlanOptions", "replan_tolerance", self.replan_tolerance, minimum=0)
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise ValueError(f"PlanOptions.calibration={type(self.calibration).__name__} is invalid: expected a "
                             "Calibration or None")
        object.__setattr__(self, "constants", CostConstants(max_efficiency=self.max_efficiency,
                                                            machine_balance=self.machine_balance,
                                                            overlapped_zero_stages=self.overlapped_zero_stages,
                                                            calibration=self.calibration))

    @property
    def recompute_codes(self) -> tuple[int, ...]:
        return tuple(RECOMPUTE.index(name) for name in self.recompute)

    @property
    def mapping_codes(self) -> tuple[int, ...]:
        return tuple(MAPPINGS.index(name) for name in self.mappings)
