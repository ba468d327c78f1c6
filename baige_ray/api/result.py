"""What a training run returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baige_ray.api.device import DeviceInfo


@dataclass(kw_only=True, frozen=True)
class StepMetrics:
    """One optimizer step, reduced over all workers."""

    step: int
    loss: float
    learning_rate: float
    step_time_s: float
    tokens: int
    peak_host_memory_gb: float = 0.0  # the largest worker's peak resident memory so far
    peak_device_memory_gb: float = 0.0  # the largest worker's peak allocated accelerator memory (0 on CPU)
    snapshot_stall_s: float = 0.0  # the longest a worker's step waited for its in-memory snapshot (launch)
    finished_at: float | None = None  # wall clock (time.time()) when the step's results were in (launch)
    # Samples the ranks drew from the policy (models.plugin.PolicySamples, GRPO's rollouts on the training
    # ranks): their reports joined, e.g. {"rewards": [...], "rollout_s": ..., "scoring_s": ...}.
    policy_samples: dict[str, Any] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0


@dataclass(kw_only=True)
class Result:
    """Outcome of `fit`: the metrics history and where the final state is."""

    metrics: list[StepMetrics] = field(default_factory=list)
    checkpoint_path: Path | None = None
    workers: list[DeviceInfo] = field(default_factory=list)
    layout: str = ""
    elapsed_s: float = 0.0
    recoveries: list[dict] = field(default_factory=list)  # elastic runs: one record per recovery
    final_state: object | None = None  # elastic runs: ObjectRef to the final weights, {"model": {name: tensor}}

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def losses(self) -> list[float]:
        return [m.loss for m in self.metrics]

    @property
    def final_loss(self) -> float | None:
        return self.metrics[-1].loss if self.metrics else None
