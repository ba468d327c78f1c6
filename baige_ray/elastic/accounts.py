"""What an elastic job's completed steps say: its step log, the deadline a hang is judged by, each
rank's compute time for the straggler policy, goodput, exported metrics and MoE expert load.

Pure bookkeeping over the metrics workers report; the controller hands it each finished step.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.step_log import StepLog
from baige_ray.elastic.step_progress import StepProgress
from baige_ray.ops.expert_load import expert_load, imbalance
from baige_ray.ops.metrics import JobMetrics, estimate_mfu

WARMUP_STEPS = 2  # first steps build caches; their times do not set the deadline
COMPUTE_HISTORY = 50  # steps of per-rank compute times the straggler policy may look at
RECENT_STEP_TIMES = 100  # what deadlines and rates read (their last 20); older ones are the step log's


class StepAccounts:
    def __init__(self, run_name: str, elastic: ElasticConfig):
        self.elastic = elastic
        self.metrics = JobMetrics(job=run_name)
        self.log: StepLog | None = None  # opened once the controller knows whether it restarted
        self.step_times: list[float] = []
        self.compute_history: list[tuple[float, ...]] = []  # each rank's compute over its expected load
        self.rank_loads: tuple[float, ...] | None = None  # the generation's relative_loads; None: all equal
        self.expert_load: list[list[int]] = []  # MoE jobs: the last step's slots per expert of each layer
        self.productive_s = 0.0
        self.started_at = time.time()
        self.generation_steps = 0  # steps completed since the last regroup
        self.num_parameters = 0
        self.progress = StepProgress()  # next_step, which callers may wait on

    @property
    def next_step(self) -> int:
        """One past the last step recorded, or past the snapshot training resumed from."""
        return self.progress.next_step

    @next_step.setter
    def next_step(self, step: int) -> None:
        self.progress.set(step)

    def open(self, path: Path, *, resume: bool) -> None:
        self.log = StepLog(path, resume=resume)

    @property
    def records(self) -> list[dict]:
        """The newest steps' records (step_log.RECENT_RECORDS of them at most)."""
        return self.log.records if self.log is not None else []

    def resume_after(self, snapshot_step: int | None) -> int:
        """Training goes on from the step after `snapshot_step` (from the start if None); steps logged
        from there on are done again. Returns the step it resumes at."""
        self.next_step = 0 if snapshot_step is None else snapshot_step + 1
        self.log.keep_before(self.next_step)
        return self.next_step

    def new_generation(self, num_parameters: int, rank_loads: tuple[float, ...] | None = None) -> None:
        """A regroup: ranks may now be other workers, so their compute times start over. `rank_loads`:
        each rank's expected compute relative to the mean (`policies.straggler.relative_loads`)."""
        self.generation_steps, self.num_parameters = 0, num_parameters
        self.compute_history, self.rank_loads = [], rank_loads

    # ----- judging the next step -----

    @property
    def warm(self) -> bool:
        # A new generation's first step (new engine, new layout, newly started workers) is no
        # slower a hang than the job's first: earlier generations' step times do not bound it.
        return len(self.step_times) >= WARMUP_STEPS and self.generation_steps > 0

    def deadline_s(self) -> float:
        """How long a step may take before the workers in it are presumed hung."""
        return self.elastic.step_deadline_s(statistics.median(self.step_times[-20:]) if self.warm else None)

    def recent_step_s(self, steps: int) -> float:
        return statistics.median(self.step_times[-steps:])

    def forget_compute_times(self) -> None:
        """After an eviction the ranks change: older per-rank times say nothing of the new ones."""
        self.compute_history = []

    # ----- recording -----

    def record(self, step: int, per_rank: list[dict], seconds: float, places: list[tuple[str, int]],
               stages: list[int]) -> None:
        """Step `step` ended after `seconds`; `places` are each rank's (node, device), `stages` its pipeline stage."""
        experts = self._record_expert_load(per_rank, stages) if "expert_tokens" in per_rank[0] else {}
        drawn = {"policy_samples": joined_reports(per_rank)} if "policy_samples" in per_rank[0] else {}
        self.log.append({**experts, **drawn,
            "step": step,
            "loss": per_rank[0]["group_loss"],
            "learning_rate": per_rank[0]["learning_rate"],
            "step_time_s": seconds,
            "finished_at": time.time(),
            "tokens": per_rank[0]["group_tokens"],
            "num_workers": len(per_rank),
            "snapshot_stall_s": max(m["snapshot_stall_s"] for m in per_rank),
            "compute_s": [round(m["compute_s"], 6) for m in per_rank],  # each rank's forward and backward
            "peak_host_memory_bytes": max(m.get("peak_host_memory_bytes", 0) for m in per_rank),
            "peak_device_memory_bytes": max(m.get("peak_device_memory_bytes", 0) for m in per_rank),
        })
        self._export(per_rank, seconds, places)
        self.step_times = (self.step_times + [seconds])[-RECENT_STEP_TIMES:]
        self.generation_steps += 1
        self.productive_s += seconds
        if self.generation_steps > WARMUP_STEPS:  # a new engine's first steps build caches: not a chip's pace
            self.compute_history = (self.compute_history + [self._paces(per_rank)])[-COMPUTE_HISTORY:]
        self.next_step = step + 1

    def _paces(self, per_rank: list[dict]) -> tuple[float, ...]:
        loads = self.rank_loads if self.rank_loads is not None and len(self.rank_loads) == len(per_rank) else None
        return tuple(m["compute_s"] / (loads[rank] if loads else 1.0) for rank, m in enumerate(per_rank))

    def record_unreported(self, per_rank: list[dict | None], step: int) -> None:
        """A step that finished everywhere but whose result died with a lost worker: any survivor holds
        the whole group's loss and tokens (its step time is unknown)."""
        reported = [m for m in per_rank if m is not None and m.get("step") == step]
        if not reported:
            return
        drawn = {"policy_samples": joined_reports(reported)} if "policy_samples" in reported[0] else {}
        self.log.append({**drawn,
            "step": step,
            "loss": reported[0]["group_loss"],
            "learning_rate": reported[0]["learning_rate"],
            "step_time_s": float("nan"),
            "tokens": reported[0]["group_tokens"],
            "num_workers": len(reported),
            "snapshot_stall_s": max(m["snapshot_stall_s"] for m in reported),
            "partial": len(reported) < len(per_rank),
        })

    def all_records(self) -> list[dict]:
        """Every step's record (from the log's file: memory keeps the newest only)."""
        return self.log.all_records() if self.log is not None else []

    def unlogged_steps(self, before: int) -> list[int]:
        logged = {record["step"] for record in self.all_records()}
        return [step for step in range(before) if step not in logged]

    def _record_expert_load(self, per_rank: list[dict], stages: list[int]) -> dict:
        self.expert_load = expert_load([m["expert_tokens"] for m in per_rank], stages)
        self.metrics.expert_imbalance(imbalance(self.expert_load))
        return {"expert_imbalance": round(imbalance(self.expert_load), 4)}

    def _export(self, per_rank: list[dict], seconds: float, places: list[tuple[str, int]]) -> None:
        tokens_per_s = sum(m["tokens"] for m in per_rank) / seconds if seconds > 0 else 0.0
        peak = self.elastic.peak_flops_per_device
        mfu = estimate_mfu(tokens_per_s, self.num_parameters, len(per_rank), peak) if peak and tokens_per_s else 0.0
        self.metrics.step(step_time_s=seconds, tokens_per_s=tokens_per_s, mfu=mfu, num_workers=len(per_rank))
        self.metrics.devices(train=len(per_rank), infer=0)
        for rank, ((node, device), reported) in enumerate(zip(places, per_rank)):
            self.metrics.worker_step(node=node, worker=rank, device=device, step_time_s=reported["compute_s"])
            self.metrics.snapshot_stall(reported["snapshot_stall_s"], node=node, worker=rank)

    # ----- what status reports -----

    def steps_per_s(self) -> float:
        recent = self.step_times[-20:]
        return len(recent) / sum(recent) if recent else 0.0

    def tokens_per_s(self, steps: int = 20) -> float:
        """Tokens trained per second over the last `steps` timed steps."""
        recent = [r for r in self.records[-steps:] if r["step_time_s"] == r["step_time_s"]]  # NaN: unreported
        seconds = sum(r["step_time_s"] for r in recent)
        return sum(r["tokens"] for r in recent) / seconds if seconds > 0 else 0.0

    def mfu(self, num_workers: int) -> float | None:
        """Model FLOPs utilization of the recent steps, when the device peak is known (ElasticConfig)."""
        peak, tokens_per_s = self.elastic.peak_flops_per_device, self.tokens_per_s()
        if not peak or not tokens_per_s or not self.num_parameters or not num_workers:
            return None
        return estimate_mfu(tokens_per_s, self.num_parameters, num_workers, peak)

    def goodput(self) -> float:
        elapsed = time.time() - self.started_at
        return self.productive_s / elapsed if elapsed > 0 else 0.0

    def report(self, num_workers: int) -> dict:
        """The job status's part about progress: rates, loss, MFU, goodput, time, the MoE experts' load."""
        return {
            "steps_per_s": self.steps_per_s(),
            "loss": self.records[-1]["loss"] if self.records else None,
            "tokens_per_s": self.tokens_per_s(),
            "mfu": self.mfu(num_workers),
            "goodput": self.goodput(),
            "started_at": self.started_at,
            "elapsed_s": time.time() - self.started_at,
            "expert_load": self.expert_load,  # the last step's slots per expert of each MoE layer
        }

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def joined_reports(per_rank: list[dict]) -> dict:
    """The ranks' reports of samples drawn from the policy as one: each holds the whole batch's rewards
    already (the workers gather them), the seconds are the slowest rank's."""
    reports = [m["policy_samples"] for m in per_rank]
    return {key: value if isinstance(value, list) else max(report[key] for report in reports)
            for key, value in reports[0].items()}
