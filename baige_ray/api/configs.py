"""User-facing configuration of a training run, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from baige_ray.api.validation import (
    require_choice,
    require_divisible,
    require_int,
    require_number,
)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
ACCELERATOR_CHOICES = ("auto", "gpu", "cpu")
HOST_ALLOCATORS = ("cached", "retain", "system")  # engines/host_allocator.py


@dataclass(kw_only=True, frozen=True)
class ScalingConfig:
    """How many worker actors to start and what each one holds.

    accelerator="auto" asks for one GPU per worker when the cluster advertises
    GPUs (real or simulated) and a CPU slot otherwise.
    """

    num_workers: int = 2
    accelerator: str = "auto"
    cpus_per_worker: float = 0.5
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 60.0
    # Added to the OS niceness Ray gives worker processes (the result capped at 19). Above 0, whatever
    # shares their hosts (a Serve replica beside a harvest rank, or the replicas and the proxy on a CPU
    # box standing in for separate devices) gets the CPU first, and training takes what is left.
    cpu_niceness: int = 0
    # The share of its device each worker holds where workers hold devices: below 1 it lands beside
    # an actor holding the rest (a reinforcement-learning rollout replica taking turns with it). Ray
    # counts the share; it does not divide the device's memory.
    device_share: float = 1.0
    # "cached": worker processes keep freed blocks under 32 MB for the next step instead of faulting
    # them in again from the kernel, and map larger ones on huge pages (a CPU step at 494M parameters:
    # 14-16 s -> 8.8 s); "retain" keeps every block (6.5 s, but 1.5-2.3 GB more resident memory per
    # worker than glibc's, which the memory check does not price); "system": glibc's defaults. See
    # engines/host_allocator.py.
    host_allocator: str = "cached"

    def __post_init__(self) -> None:
        require_int("ScalingConfig", "num_workers", self.num_workers, minimum=1)
        require_choice("ScalingConfig", "host_allocator", self.host_allocator, HOST_ALLOCATORS)
        require_number("ScalingConfig", "device_share", self.device_share, minimum=0, exclusive_minimum=True,
                       maximum=1)
        require_int("ScalingConfig", "cpu_niceness", self.cpu_niceness, minimum=0)
        if self.cpu_niceness > 19:
            raise ValueError(f"ScalingConfig.cpu_niceness={self.cpu_niceness} is invalid: expected 0 to 19")
        require_choice("ScalingConfig", "accelerator", self.accelerator, ACCELERATOR_CHOICES)
        require_number("ScalingConfig", "cpus_per_worker", self.cpus_per_worker, minimum=0)
        require_choice(
            "ScalingConfig", "placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES
        )
        require_number(
            "ScalingConfig", "placement_timeout_s", self.placement_timeout_s, minimum=0, exclusive_minimum=True
        )


PRECISIONS = ("fp32", "bf16-mixed")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The optimisation problem, independent of how many workers share it.

    global_batch_size is the number of sequences per optimizer step over all
    workers; micro_batch_size (per worker) sets gradient accumulation, so the
    mathematics of a step does not change with the layout.

    precision "bf16-mixed" computes in bfloat16 and keeps fp32 weights, gradient reductions and
    optimizer state (FSDP2's mixed-precision policy, DeepSpeed's bf16 mode, torch.autocast elsewhere).

    world_size_invariant makes every step's update the same bits at any number of data-parallel workers
    (an elastic job that shrinks trains exactly as one that did not): each micro-batch's gradient is
    computed on its own and all are summed exactly (engines/exact_gradients.py). It needs
    micro_batch_size, the fixed shard, and data parallelism by DDP alone.
    """

    num_steps: int
    global_batch_size: int = 32
    micro_batch_size: int | None = None
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 1
    precision: str = "fp32"
    world_size_invariant: bool = False

    def __post_init__(self) -> None:
        require_int("TrainConfig", "num_steps", self.num_steps, minimum=1)
        require_choice("TrainConfig", "precision", self.precision, PRECISIONS)
        require_int("TrainConfig", "global_batch_size", self.global_batch_size, minimum=1)
        if self.micro_batch_size is not None:
            require_int("TrainConfig", "micro_batch_size", self.micro_batch_size, minimum=1)
        require_number("TrainConfig", "learning_rate", self.learning_rate, minimum=0, exclusive_minimum=True)
        require_number("TrainConfig", "min_learning_rate", self.min_learning_rate, minimum=0)
        if self.min_learning_rate > self.learning_rate:
            raise ValueError(
                f"TrainConfig.min_learning_rate={self.min_learning_rate!r} is invalid: "
                f"expected a number <= learning_rate={self.learning_rate!r}"
            )
        require_int("TrainConfig", "warmup_steps", self.warmup_steps, minimum=0)
        require_number("TrainConfig", "weight_decay", self.weight_decay, minimum=0)
        require_number("TrainConfig", "grad_clip", self.grad_clip, minimum=0)
        require_int("TrainConfig", "seed", self.seed, minimum=0)
        require_int("TrainConfig", "log_every", self.log_every, minimum=1)
        if not isinstance(self.world_size_invariant, bool):
            raise ValueError(f"TrainConfig.world_size_invariant={self.world_size_invariant!r} is invalid: "
                             "expected True or False")
        if self.world_size_invariant and self.micro_batch_size is None:
            raise ValueError("TrainConfig.world_size_invariant=True is invalid without micro_batch_size: expected "
                             "the micro-batch size, the fixed shard of the batch each gradient is computed on")
        if self.world_size_invariant and self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"TrainConfig.micro_batch_size={self.micro_batch_size!r} is invalid with "
                             f"world_size_invariant: expected a divisor of global_batch_size={self.global_batch_size}")

    @property
    def compute_dtype_bytes(self) -> int:
        """Bytes of the weights and activations the forward and backward compute with."""
        return 2 if self.precision == "bf16-mixed" else 4

    def per_worker_batch(self, num_workers: int) -> int:
        """Sequences each worker handles per step; the global batch must split evenly."""
        require_divisible("TrainConfig", "global_batch_size", self.global_batch_size, num_workers, "num_workers")
        per_worker = self.global_batch_size // num_workers
        if self.micro_batch_size is not None:
            require_divisible(
                "TrainConfig", "micro_batch_size", per_worker, self.micro_batch_size, "micro_batch_size"
            )
        return per_worker


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """Where results go and how the run reports itself."""

    name: str = "baige-run"
    storage_path: Path = field(default_factory=lambda: Path.home() / "baige_ray_results")
    show_progress: bool = True  # a progress line on stderr: fit's steps, or a launch job's until wait()
    step_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(
                f"RunConfig.name={self.name!r} is invalid: expected a non-empty string without '/'"
            )
        object.__setattr__(self, "storage_path", Path(self.storage_path).expanduser().resolve())  # workers run elsewhere
        require_number("RunConfig", "step_timeout_s", self.step_timeout_s, minimum=0, exclusive_minimum=True)

    @property
    def run_dir(self) -> Path:
        return self.storage_path / self.name
