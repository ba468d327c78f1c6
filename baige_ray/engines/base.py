"""What every engine shares: the data slice of a rank, the learning-rate schedule, metrics, slow-chip emulation."""

from __future__ import annotations

import resource
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from baige_ray.engines.host_allocator import give_back_under_pressure
from baige_ray.engines.train_job import TrainJob, learning_rate_at, replica_sample_range
from baige_ray.models.adapters import add_lora
from baige_ray.models.plugin import PolicySamples, SampleSource, stage_ranges
from baige_ray.parallel import context_parallel
from baige_ray.parallel.context_parallel import ContextParallel, global_positions
from baige_ray.parallel.distributed import all_reduce_abortable
from baige_ray.parallel.layout import ParallelLayout, RankCoords
from baige_ray.parallel.state import CanonicalState


def peak_host_memory_bytes() -> int:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_device_memory_bytes(device: torch.device) -> int:
    """The most this process has held allocated on its accelerator so far (0 on a CPU worker, whose
    device memory is its resident memory)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return 0


class SlowChipEmulator:
    """Makes a module behave like a chip `speed` times as fast as this one, forward and backward alike.

    After the module's forward it sleeps (1/speed - 1) x that forward's work, and after
    the backward through it (1/speed - 1) x that backward's work, timed from the gradient
    reaching the module's output to the end of the backward pass. Each piece of work is
    stretched by its own measured time, so a stage whose backward costs 1.5x or 2.2x its
    forward (embedding, LM head, attention) is exactly 1/speed as fast, not approximately.

    Work is measured in this thread's CPU time: on cores shared with other processes the
    wall time of a forward also holds the time they ran instead, which is the machine's
    load, not the chip's speed, and must not be multiplied by 1/speed (a worker that
    sleeps is preempted more than one that computes without pause, which made the
    emulated half-speed chip measure 0.45, and anywhere from 0.3 to 0.5 under load).
    Sleeping, unlike spinning, leaves the shared cores to the other workers. A sleep
    overshoots (timer slack, waiting for a core: a millisecond or more, two sleeps per
    micro-batch); the overshoot is taken off the next sleep, so the emulated delay stays
    exact over a step instead of growing with the micro-batch count.
    """

    def __init__(
        self,
        module: nn.Module,
        speed: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        work_clock: Callable[[], float] = time.thread_time,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._clock, self._work_clock, self._sleep = clock, work_clock, sleep
        self.slowdown = 0.0
        self._owed_s = 0.0  # emulated delay not slept yet; negative after oversleeping
        self.set_speed(speed)
        self._started = self._work_started = 0.0
        # This step's forward and backward wall time, emulation included: the chip's own pace. The backward
        # ends before data parallelism waits for the peers' gradients (that wait is queued after it).
        self.forward_s = self.backward_s = 0.0
        # Hooks stay registered even at full speed so a fault can slow the chip later.
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)

    def set_speed(self, speed: float) -> None:
        self.slowdown = max(0.0, 1.0 / speed - 1.0)
        self._owed_s = 0.0

    def _stretch(self, worked_s: float) -> None:
        """Sleep so that `worked_s` of real work takes worked_s / speed in all."""
        self._owed_s += self.slowdown * worked_s
        if self._owed_s > 0:
            started = self._clock()
            self._sleep(self._owed_s)
            self._owed_s -= self._clock() - started

    def _before_forward(self, *_: object) -> None:
        self._started, self._work_started = self._clock(), self._work_clock()

    def _after_forward(self, _module: nn.Module, _args: object, output: object) -> None:
        if self.slowdown > 0:
            self._stretch(self._work_clock() - self._work_started)
        node = _output_grad_fn(output) if torch.is_grad_enabled() else None
        if node is not None:
            node.register_prehook(self._before_backward)
        self.forward_s += self._clock() - self._started

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def reset(self) -> None:
        self.forward_s = self.backward_s = 0.0

    def _before_backward(self, _grad_outputs: object) -> None:
        started, work_started = self._clock(), self._work_clock()
        # Runs once the whole backward pass (this module's part of it last) has finished, before DDP's own
        # callback, queued later, waits for the all-reduce.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._after_backward(started, work_started))

    def _after_backward(self, started: float, work_started: float) -> None:
        if self.slowdown > 0:
            self._stretch(self._work_clock() - work_started)
        self.backward_s += self._clock() - started


def _output_grad_fn(output: object) -> torch.autograd.graph.Node | None:
    """The autograd node that produced the module's (first differentiable) output, if any."""
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
            return tensor.grad_fn
    return None


def document_positions(positions: torch.Tensor | None, chunk: slice, device: torch.device) -> dict:
    """The keyword input a model stage takes for a micro-batch of packed documents (nothing otherwise)."""
    return {} if positions is None else {"positions": positions[chunk].to(device)}


def step_trained_tokens(data: SampleSource, indices: range, seed: int, job: TrainJob) -> int:
    """The trained tokens of samples `indices`: the source's own count where it keeps one, else the
    job's count over their targets."""
    counted = getattr(data, "trained_tokens", None)
    if counted is not None:
        return int(counted(indices, seed))
    return job.trained_tokens(data.batch(indices, seed)[1])


class Engine(ABC):
    """One rank's training: `train_step`, and state in and out in canonical form."""

    def __init__(
        self,
        job: TrainJob,
        layout: ParallelLayout,
        rank: int = 0,
        *,
        device: str = "cpu",
        emulated_speed: float = 1.0,
        data: SampleSource | PolicySamples | None = None,
    ):
        self.job = job
        self.plugin = job.plugin
        self.layout = layout
        self.rank = rank
        self.device = torch.device(device)
        self.emulated_speed = emulated_speed
        self.coords: RankCoords = layout.coords(rank)
        self.replica_batches = layout.replica_batches(job.train)
        self.per_replica_batch = self.replica_batches[self.coords.dp]
        self.data = data or job.open_data()
        self.before_update_hooks: list[Callable[[], None]] = []
        self.emulators: list[SlowChipEmulator] = []
        self.expert_layers: list[nn.Module] = []  # the MoE layers this rank holds (set by engines that run them)
        self.context_parallel: ContextParallel | None = None  # set by engines whose layout has cp > 1
        self._policy_decoder = None  # PolicySamples' decoder over this rank's module, made at its first draw
        self.tokens_per_sample: float | None = None  # this step's trained tokens per sample (see `loss`)

    def train_step(self, step: int) -> dict:
        for emulator in self.emulators:
            emulator.reset()
        learning_rate = learning_rate_at(step, self.job.train)
        self.set_learning_rate(learning_rate)
        inputs, targets = self.batch(step)
        self.tokens_per_sample = self.step_tokens_per_sample(step)
        loss = self.forward_backward(inputs, targets, self.positions(step))
        # Forward and backward, each rank's own: the wait for the peers' gradients comes after the backward
        # this measures, and the update's. A throttled worker (stopped in turns) showed it in its forward
        # alone in too few steps: a forward is shorter than the turns.
        compute_s = sum(emulator.compute_s for emulator in self.emulators)
        for hook in self.before_update_hooks:  # e.g. a snapshot still copying the weights this update changes
            hook()
        self.optimizer_step()
        give_back_under_pressure()
        # One rank per data-parallel replica (context-parallel peers each train a part of the same rows).
        counts_tokens = self.coords.tp == 0 and self.coords.pp == 0 and self.coords.cp == 0
        metrics = {
            "step": step,
            "loss": loss,
            "learning_rate": learning_rate,
            "tokens": inputs.numel() if counts_tokens else 0,
            "compute_s": compute_s,
            "peak_host_memory_bytes": peak_host_memory_bytes(),
            "peak_device_memory_bytes": peak_device_memory_bytes(self.device),
        }
        if self.expert_layers:
            metrics.update(self.take_expert_traffic())
        metrics.update(self.step_traffic())
        if isinstance(self.data, PolicySamples):
            metrics["policy_samples"] = self.data.report(step)
        return metrics

    def check_recomputation(self, stages: list[nn.Module]) -> None:
        """ValueError where recomputing blocks in backward would count their forward twice: a mixture of experts
        adds its auxiliary loss and routed-token counts as each forward runs."""
        if self.plugin.has_auxiliary_loss or any(self.plugin.expert_modules(stage) for stage in stages):
            raise ValueError(f"ParallelLayout.recompute={self.layout.recompute!r} is invalid for "
                             f"{self.plugin.describe()}: its expert layers add auxiliary losses and token counts "
                             "in each forward, which recomputation would run twice; expected recompute='none'")

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The job's loss of one micro-batch, normalised by the whole step's trained tokens (every micro-batch
        of every replica): engines average micro-batch losses, so without it a micro-batch holding few
        trained tokens (a short reply, a masked prompt) would weigh as much as one holding many, and the
        step's gradient would change with the micro-batch size and the number of replicas."""
        return self.job.loss(logits, targets, self.tokens_per_sample)

    def step_tokens_per_sample(self, step: int) -> float | None:
        """The trained tokens of step `step`'s global batch per sample, which every rank counts alone from
        the data (any rank reads any sample); None where the loss is not a token mean, or where samples
        are drawn as the step runs (PolicySamples): each micro-batch then averages its own."""
        if not self.job.normalises_by_tokens or self.data is None or isinstance(self.data, PolicySamples):
            return None
        global_batch = sum(self.replica_batches)
        samples = range(step * global_batch, (step + 1) * global_batch)
        return step_trained_tokens(self.data, samples, self.job.train.seed, self.job) / global_batch

    def take_expert_traffic(self) -> dict:
        """This step's routed slots per expert of each MoE layer held here (tensor-parallel peers see the
        same tokens, so only TP rank 0 counts them) and the seconds spent in expert all-to-alls."""
        counts, seconds = zip(*(layer.traffic.take(self.forwards_per_step) for layer in self.expert_layers))
        per_layer = [c.tolist() if c is not None and self.coords.tp == 0 else [] for c in counts]
        return {"expert_tokens": per_layer, "all_to_all_s": sum(seconds)}

    def step_traffic(self) -> dict:
        """Bytes this rank's step sent for its engine's own exchanges, by name: context parallelism's
        attention exchanges, forward and backward, where it runs (none otherwise)."""
        if self.context_parallel is None:
            return {}
        return {"context_parallel_bytes": context_parallel.SENT.take()}

    def build_context_parallel(self, group) -> ContextParallel:
        """This rank's context parallelism over `group`, the CP ranks of its replica; a ValueError for a job
        it cannot split."""
        if not self.job.normalises_by_tokens or isinstance(self.data, PolicySamples):
            raise ValueError(f"ParallelLayout.cp={self.layout.cp} is invalid for this job: each context-parallel "
                             "rank sums the loss of its part of every sequence, which needs a loss normalised by the "
                             "step's trained tokens (the model's own, or an objective's token mean) and samples "
                             "read from data, not drawn from the policy")
        return ContextParallel(group, self.layout.cp, self.coords.cp, self.layout.cp_kind)

    def on_local_tokens(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
                        accumulate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], float]) -> float:
        """`accumulate` (an engine's micro-batch loop) run on this rank's part of every sequence, attending
        across the CP group; the loss reported is the replica's, summed over the group."""
        batch, length = inputs.shape
        whole_positions = positions.to(self.device) if positions is not None else None
        local_inputs, local_targets, local_positions = self.context_parallel.split(
            inputs.to(self.device), targets.to(self.device),
            global_positions(whole_positions, batch, length, self.device))
        with self.context_parallel.attending(length, whole_positions):
            local = accumulate(local_inputs, local_targets, local_positions)
        total = torch.tensor(local, dtype=torch.float64)
        all_reduce_abortable(total, self.context_parallel.group)
        return float(total)

    @property
    def forwards_per_step(self) -> int | None:
        """Forwards of each layer a step runs, where a step may run extra ones to discard; None: all count."""
        return None

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = replica_sample_range(step, self.coords.dp, self.replica_batches)
        if isinstance(self.data, PolicySamples):
            return self._draw_from_policy(step, indices)
        return self.data.batch(indices, self.job.train.seed)

    def positions(self, step: int) -> torch.Tensor | None:
        """Each input token's position in its document, for samples that pack several documents per
        sequence (`SampleSource.positions`); None where every sample is one document from position 0."""
        positions = getattr(self.data, "positions", None)
        if positions is None:
            return None
        return positions(replica_sample_range(step, self.coords.dp, self.replica_batches), self.job.train.seed)

    def _draw_from_policy(self, step: int, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        """PolicySamples' samples, drawn by this rank's own weights in eval mode (no dropout), which
        the training step then updates in place."""
        stage = self.policy_stage()
        if self._policy_decoder is None:
            self._policy_decoder = self.plugin.policy_decoder(stage)
        training = stage.training
        stage.eval()
        try:
            return self.data.policy_batch(self._policy_decoder, step, indices, self.job.train.seed)
        finally:
            stage.train(training)

    def policy_stage(self) -> nn.Module:
        """The module of the whole model this rank trains, for samples drawn from the policy: only where
        each rank holds all of it (PolicySamples)."""
        raise ValueError(f"the {type(self).__name__} cannot draw samples from the policy it trains: expected the "
                         "torch engine with data parallelism by DDP (or one rank)")

    def build_stages(self) -> list[nn.Module]:
        """The pipeline stages this rank holds (the whole model without pipelining), canonical names kept."""
        layers = self.plugin.layers_per_stage(self.layout)
        ranges = stage_ranges(layers, self.layout.stage_indices(self.coords.pp))
        stages = self.plugin.build_stages(ranges, self.device, self.job.train.seed)
        if self.job.adapter is not None:
            add_lora(stages, self.job.adapter, self.job.train.seed)
        return stages

    def set_emulated_speed(self, speed: float) -> None:
        """Change how fast this rank's chip appears, e.g. to inject a straggler."""
        self.emulated_speed = speed
        for emulator in self.emulators:
            emulator.set_speed(speed)

    def snapshot_state(self, into: CanonicalState | None = None) -> CanonicalState:
        """Everything this rank can restore from (by default the collective canonical export).

        `into`, an earlier snapshot no one reads any more, may be overwritten to save allocations.
        """
        return self.export_state()

    def snapshot_source(self) -> Callable:
        """Called on the training thread after a step: what the snapshot copy calls, perhaps on another
        thread beside the next step, with the buffers to write into (`snapshot_state`'s `into`)."""
        return self.snapshot_state

    @property
    def snapshot_is_local(self) -> bool:
        """True when `snapshot_state` needs no collective, so it may run beside the next step."""
        return False

    @property
    def snapshot_is_sharded(self) -> bool:
        """True when `snapshot_state` returns this rank's pieces only (a `ShardedPart`): restoring a stage
        then needs the part of every rank of that stage (shards.assemble)."""
        return False

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The unwrapped module whose parameter names are the canonical names."""

    @abstractmethod
    def set_learning_rate(self, learning_rate: float) -> None: ...

    @abstractmethod
    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         positions: torch.Tensor | None = None) -> float | None:
        """Accumulate this step's gradients; the batch-mean loss, or None on ranks that never see it.
        `positions`: each input token's position in its document, for packed documents (ModelPlugin.loss
        and `positions` above); the model then attends within each document only."""

    @abstractmethod
    def optimizer_step(self) -> None: ...

    @abstractmethod
    def export_state(self) -> CanonicalState:
        """Collective: every rank calls it; owners of a name return it, others an empty part."""

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Collective: the full weights on the owners of their names, nothing elsewhere. Unlike
        export_state, no optimizer state and no full copy on ranks that do not keep it."""
        return self.export_state()["model"]

    @abstractmethod
    def import_state(self, state: CanonicalState) -> None: ...

    @property
    def owns_state(self) -> bool:
        """Exactly one rank per pipeline stage returns that stage's state."""
        return self.coords.dp == 0 and self.coords.tp == 0 and self.coords.cp == 0
