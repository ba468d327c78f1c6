"""The torch-native engine: any DP x EP x TP x PP layout from one device mesh.

DP by DDP, FSDP2 or an explicit gradient all-reduce; TP by DTensor; EP by sharding each
expert layer's experts over the expert-parallel group (models/moe.py moves the tokens);
PP by torch.distributed.pipelining (1F1B with upstream stages running ahead, see
pipeline_schedule.py, or interleaved 1F1B); CP by splitting every sequence over the context-parallel
group and attending across it (parallel/context_parallel.py), gradients reduced over dp x cp.
The mesh's dimensions (pp, dp, cp, tp) follow the layout's row-major rank order, with dp
split into (edp, ep) under expert parallelism, so its groups are exactly the plan's groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from baige_ray.engines import parallelize
from baige_ray.engines.base import Engine, SlowChipEmulator, document_positions
from baige_ray.engines.exact_gradients import ExactGradientSum, check_world_size_invariant
from baige_ray.engines.train_job import TrainJob, build_optimizer
from baige_ray.failpoints import BACKWARD, fail_point
from baige_ray.models.aux_loss import auxiliary_losses, mark_forward
from baige_ray.parallel.boxes import is_dtensor
from baige_ray.parallel.context_parallel import ContextParallel
from baige_ray.parallel.distributed import all_reduce_abortable
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.sequence_parallel import split_sequence_across
from baige_ray.parallel.shards import LocalSources, ShardCopy, ShardedPart
from baige_ray.parallel.state import (
    CanonicalState,
    export_module_state,
    full_tensor,
    import_module_state,
    trainable_parameters,
)


class TorchEngine(Engine):
    def __init__(self, job: TrainJob, layout: ParallelLayout, rank: int = 0, **options: Any):
        super().__init__(job, layout, rank, **options)
        check_world_size_invariant(job.train, layout)
        self.meshes = self._build_meshes()
        self.context_parallel = self._build_context_parallel()
        self._pipeline_ends = self._build_pipeline_ends_group()
        self.stages = self._build_stages()
        self.expert_layers = [layer for stage in self.stages for layer in self.plugin.expert_modules(stage)]
        self.emulators = [SlowChipEmulator(stage, self.emulated_speed) for stage in self.stages]
        self._expert_parameters = self._find_expert_parameters()
        self._wrapped = self._apply_data_parallel()
        self._modules = nn.ModuleList(self.stages)  # one namespace for state and optimizer
        self.optimizer = build_optimizer(self._modules, job.train)
        self.schedule = self._build_schedule() if layout.pp > 1 else None
        self._tp_replicated_parameters = self._find_tp_replicated_parameters()
        self._pipeline_tied_parameters = [p for stage in self.stages for p in self.plugin.pipeline_tied_parameters(stage)]
        self.exact_sum = self._build_exact_sum()

    def _build_meshes(self) -> dict[str, DeviceMesh]:
        """One-dimensional meshes by name, for the dimensions of more than one rank: pp, dp, tp, and
        with expert parallelism ep and edp (the replicas holding the same experts); empty on a single
        rank. All are slices of one mesh, as FSDP2 with TP needs.

        A dimension of one rank gets no mesh: its process groups of one would do nothing but cost
        each rank a gloo transport thread that wakes 100 times a second, CPU the steps share."""
        if self.layout.world_size == 1:
            return {}
        if dist.get_world_size() != self.layout.world_size:
            raise ValueError(
                f"layout {self.layout.describe()} needs {self.layout.world_size} ranks; "
                f"the process group has {dist.get_world_size()}"
            )
        layout = self.layout
        if layout.ep == 1:
            sizes = {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}
        else:
            sizes = {"pp": layout.pp, "edp": layout.dp // layout.ep, "ep": layout.ep, "cp": layout.cp, "tp": layout.tp}
        return parallelize.sliced_meshes(self.device.type, sizes)

    def _build_context_parallel(self) -> ContextParallel | None:
        return self.build_context_parallel(self.meshes["cp"].get_group()) if self.layout.cp > 1 else None

    def _build_exact_sum(self) -> ExactGradientSum | None:
        """Under TrainConfig.world_size_invariant: the exact sum of every micro-batch's gradient over dp."""
        train = self.job.train
        if not train.world_size_invariant:
            return None
        group = self.meshes["dp"].get_group() if self.layout.dp > 1 else None
        return ExactGradientSum(self.parameters, train.global_batch_size // train.micro_batch_size, group)

    def _build_pipeline_ends_group(self) -> dist.ProcessGroup | None:
        """The first- and last-stage peers of this rank when the model ties the pipeline's ends."""
        if self.layout.pp == 1 or not self.plugin.ties_pipeline_ends:
            return None
        return parallelize.pipeline_ends_group(self.layout.world_size, self.layout.pp, self.rank)

    def _build_stages(self) -> list[nn.Module]:
        stages = self.build_stages()
        if self.layout.cp > 1:
            for stage in stages:
                self.plugin.enable_context_parallel(stage)
        if self.layout.recompute == "full":
            # Before TP's and sequence parallelism's hooks on the blocks: the recomputed forward then passes
            # through them as the first one did, as under torchtitan's checkpoint wrapper
            self.check_recomputation(stages)
            for stage in stages:
                parallelize.apply_activation_recomputation(self.plugin.stage_blocks(stage))
        if self.layout.tp > 1:
            sequence_plan = self.plugin.sequence_parallel_plan(self.layout.tp) if self.layout.sequence_parallel else None
            plan = sequence_plan or self.plugin.tensor_parallel_plan(self.layout.tp)
            for stage in stages:
                blocks = self.plugin.stage_blocks(stage)
                parallelize.apply_tensor_parallel(blocks, self.meshes["tp"], plan)
                if sequence_plan is not None:
                    split_sequence_across(blocks, self.meshes["tp"])
                self.plugin.shard_vocabulary(stage, self.meshes["tp"])
        if self.layout.ep > 1:
            for stage in stages:
                parallelize.apply_expert_parallel(self.plugin.expert_modules(stage), self.meshes["ep"])
        return stages

    def _find_expert_parameters(self) -> dict[int, nn.Parameter]:
        """The parameters sharded by expert index, by id: their gradients are reduced over edp, not dp."""
        if self.layout.ep == 1:
            return {}
        return {id(param): param for layer in self.expert_layers for param in layer.parameters()
                if is_dtensor(param)}

    def _find_tp_replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters whole on every TP rank whose gradient each rank computes only in part."""
        names = self.plugin.tensor_parallel_replicated_names()
        if self.layout.tp == 1 or not names:
            return []
        return [param for stage in self.stages for block in self.plugin.stage_blocks(stage)
                for name, param in block.named_parameters() if name in names]

    def _apply_data_parallel(self) -> list[nn.Module]:
        """Modules to call: FSDP2 shards in place (over dp x cp), DDP wraps; explicit all-reduce wraps nothing."""
        if self.layout.gradient_replicas == 1:
            return list(self.stages)
        if self.layout.data_parallel == "fsdp2":
            experts = set(self._expert_parameters.values())
            for stage in self.stages:
                parallelize.apply_fsdp(stage, self.plugin.stage_blocks(stage), self.meshes["replicas"],
                                       ignored=experts, compute_dtype=self._compute_dtype)
            return list(self.stages)
        if self.uses_torch_ddp:
            group = self.meshes["replicas"].get_group()
            zero_loss = self._zero_loss_of_one_sample()
            return [parallelize.apply_ddp(s, group, self.device.type != "cpu", zero_loss) for s in self.stages]
        return list(self.stages)

    def _zero_loss_of_one_sample(self) -> Callable[[nn.Module], torch.Tensor] | None:
        """Zero times the loss of the first sample's first few tokens, to settle DDP's buckets (see
        apply_ddp); None for a pipeline stage (no loss of its own) or routed experts (their counters
        and auxiliary losses would record it)."""
        if self.layout.pp > 1 or self.expert_layers:
            return None
        inputs, targets = self.batch(0)
        tokens = min(8, inputs.shape[1])
        inputs, targets = inputs[:1, :tokens].to(self.device), targets[:1, :tokens].to(self.device)
        devices = [] if self.device.type == "cpu" else [self.device.index or 0]

        def zero_loss(module: nn.Module) -> torch.Tensor:
            with torch.random.fork_rng(devices=devices, device_type=self.device.type):  # dropout draws none
                return self.job.loss(module(inputs), targets, 1.0) * 0.0  # a sum: 0 even where no target is trained

        return zero_loss

    @property
    def uses_torch_ddp(self) -> bool:
        # DDP cannot hold DTensor parameters; with TP or EP the gradients are all-reduced explicitly.
        return (self.layout.gradient_replicas > 1 and self.layout.data_parallel == "ddp"
                and not self.explicit_dp_all_reduce and not self.job.train.world_size_invariant)

    @property
    def explicit_dp_all_reduce(self) -> bool:
        return (self.layout.gradient_replicas > 1 and self.layout.data_parallel == "ddp"
                and (self.layout.tp > 1 or self.layout.ep > 1))

    def _build_schedule(self):
        # Imported here: torch's pipelining imports FSDP2 and DTensor (1.3 s), which a worker that trains
        # without a pipeline never needs.
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

        from baige_ray.engines.pipeline_schedule import ScheduleRunAhead1F1B

        num_micro = self.layout.microbatches(self.per_replica_batch)
        pp_group = self.meshes["pp"].get_group()
        # torch's first step also runs each stage once on uninitialized inputs to infer shapes: marking
        # every forward lets the step count only its own micro-batches' auxiliary losses and expert load.
        for stage in self.stages:
            stage.register_forward_pre_hook(lambda *_: mark_forward())
        pipeline_stages = [
            PipelineStage(module, index, self.layout.num_stages, self.device, group=pp_group)
            for module, index in zip(self._wrapped, self.layout.stage_indices(self.coords.pp))
        ]
        if self.layout.pipeline_schedule == "interleaved-1f1b":
            return ScheduleInterleaved1F1B(pipeline_stages, num_micro, loss_fn=self.loss)
        return ScheduleRunAhead1F1B(
            pipeline_stages[0], num_micro, self.loss, run_ahead=self.layout.pipeline_run_ahead
        )

    @property
    def module(self) -> nn.Module:
        return self._modules

    def policy_stage(self) -> nn.Module:
        layout = self.layout
        if (layout.tp > 1 or layout.pp > 1 or layout.ep > 1 or layout.cp > 1
                or (layout.dp > 1 and layout.data_parallel != "ddp")):
            raise ValueError(f"layout {layout.describe()} is invalid for samples drawn from the policy on the "
                             "training ranks: each rank must hold the whole model, unsharded (data parallelism "
                             "by DDP, or one rank)")
        return self.stages[0]

    def set_learning_rate(self, learning_rate: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate

    @property
    def _compute_dtype(self) -> torch.dtype | None:
        """bfloat16 under mixed precision, None in fp32."""
        return torch.bfloat16 if self.job.train.precision == "bf16-mixed" else None

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision where FSDP2's own policy does not cast: DDP, TP, PP, one rank."""
        if self._compute_dtype is None or (self.layout.gradient_replicas > 1 and self.layout.data_parallel == "fsdp2"):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._compute_dtype)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         positions: torch.Tensor | None = None) -> float | None:
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with self._autocast():
            if self.schedule is not None:
                return self._pipeline_forward_backward(inputs, targets, positions)
            if self.context_parallel is not None:
                return self._accumulate_context_parallel(inputs, targets, positions)
            return self._accumulate(inputs, targets, positions)

    def _pipeline_forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                                   positions: torch.Tensor | None) -> float | None:
        holds_first = 0 in self.layout.stage_indices(self.coords.pp)
        holds_last = self.layout.num_stages - 1 in self.layout.stage_indices(self.coords.pp)
        losses: list[torch.Tensor] = []
        args = (inputs,) if holds_first else ()
        kwargs = {"target": targets, "losses": losses} if holds_last else {}
        # torch's schedules give keyword inputs to every stage, each micro-batch its slice: every stage
        # needs the positions (its own masks and rotary embeddings), not only the first.
        kwargs.update(document_positions(positions, slice(None), self.device))
        num_micro = self.layout.microbatches(self.per_replica_batch)
        with auxiliary_losses(weight=1.0) as aux:  # the schedule divides all gradients by the micro-batch count
            self.schedule.step(*args, **kwargs)
        # Only the step's own forwards (see _build_schedule).
        aux_mean = self._pipeline_auxiliary_loss(aux.total_of_last(num_micro * len(self.stages)) / num_micro)
        return float(torch.stack(losses).detach().mean()) + aux_mean if holds_last else None

    @property
    def forwards_per_step(self) -> int | None:
        # A pipeline's first step adds a shape-inference forward: count the micro-batches' only.
        return self.layout.microbatches(self.per_replica_batch) if self.schedule is not None else None

    def _pipeline_auxiliary_loss(self, local_mean: float) -> float:
        """Every stage's layers add their auxiliary losses; the sum reaches the last stage, which reports it."""
        if not self.plugin.has_auxiliary_loss:
            return 0.0
        total = torch.tensor(local_mean, dtype=torch.float64)
        all_reduce_abortable(total, self.meshes["pp"].get_group())
        return float(total)

    def _accumulate_context_parallel(self, inputs: torch.Tensor, targets: torch.Tensor,
                                     positions: torch.Tensor | None) -> float:
        """This rank's part of every sequence: its loss and gradient are its tokens' share of the replica's,
        which the reduction over dp x cp sums; the loss reported is the replica's, summed over the CP group."""
        return self.on_local_tokens(inputs, targets, positions, self._accumulate)

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None) -> float:
        (model,) = self._wrapped
        micro = self.job.train.micro_batch_size or self.per_replica_batch
        num_micro = self.per_replica_batch // micro
        # Replicas average their gradients, so each micro-batch weighs dp / (all replicas' micro-batches):
        # the batch mean even when replicas on faster chips train more micro-batches (= 1 / num_micro if even).
        # The exact sum adds the replicas' gradients instead of averaging them. Context-parallel ranks count as
        # replicas here: the average over dp x cp of their gradients, each cp times its share, sums the shares.
        replicas_averaged = 1 if self.exact_sum is not None else self.layout.gradient_replicas
        weight_divisor = self.job.train.global_batch_size / micro / replicas_averaged
        loss_sum = 0.0
        with auxiliary_losses(weight=1.0 / weight_divisor) as aux:
            for index in range(num_micro):
                chunk = slice(index * micro, (index + 1) * micro)
                with self._gradient_sync(model, index == num_micro - 1):
                    logits = model(inputs[chunk], **document_positions(positions, chunk, self.device))
                    loss = self.loss(logits, targets[chunk]) / weight_divisor
                    fail_point(BACKWARD)
                    loss.backward()
                if self.exact_sum is not None:
                    self.exact_sum.take_shard()
                loss_sum += loss.item()
        # In units whose mean over the replicas (as fit and the elastic workers reduce it) is the batch mean.
        return (loss_sum + aux.total / weight_divisor) * (self.layout.dp / replicas_averaged)

    def _gradient_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        if isinstance(model, nn.parallel.DistributedDataParallel) and not sync:
            return model.no_sync()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter on the last micro-batch only
            model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def optimizer_step(self) -> None:
        if self.exact_sum is not None:
            self.exact_sum.reduce()
        if self.layout.tp > 1:
            parallelize.settle_gradient_placements(self.parameters)
        if self._pipeline_ends is not None:  # both ends' copies of a tied weight get the sum of their gradients
            parallelize.all_reduce_gradients(self._pipeline_tied_parameters, self._pipeline_ends, divide_by=1)
        if replicated := self._tp_replicated_parameters:
            parallelize.all_reduce_gradients(replicated, self.meshes["tp"].get_group(), divide_by=1)
        if self.explicit_dp_all_reduce:
            self._all_reduce_dense_gradients()
        if self._expert_parameters and self.layout.gradient_replicas > 1:
            self._all_reduce_expert_gradients()
        if self.job.train.grad_clip > 0:
            pp_group = self.meshes["pp"].get_group() if self.layout.pp > 1 else None
            parallelize.clip_grad_norm(self.parameters, self.job.train.grad_clip, pp_group, self._duplicate_parameters)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def _duplicate_parameters(self) -> list[nn.Parameter]:
        """A tied weight's last-stage copy: the first stage's copy counts it in the global gradient norm."""
        return self._pipeline_tied_parameters if self._pipeline_ends is not None and self.coords.pp > 0 else []

    def _all_reduce_dense_gradients(self) -> None:
        """Average dense gradients over dp (FSDP2 reduce-scatters its own)."""
        dense = [p for p in self.parameters if id(p) not in self._expert_parameters]
        parallelize.all_reduce_gradients(dense, self.meshes["replicas"].get_group())

    def _all_reduce_expert_gradients(self) -> None:
        """An expert's gradient already sums what its expert group's replicas sent it, so it is summed
        over the ranks holding the same experts (edp, and cp: each context-parallel rank sent its part of
        the sequences) and divided by dp x cp, as the dense gradients are averaged."""
        experts = [p for p in self.parameters if id(p) in self._expert_parameters]
        group = self.meshes["expert_replicas"].get_group() if "expert_replicas" in self.meshes else None
        parallelize.all_reduce_gradients(experts, group, divide_by=self.layout.gradient_replicas)

    def export_state(self) -> CanonicalState:
        state = export_module_state(self.module, self.optimizer)
        return self._strip_prefix(state) if self.owns_state else {"model": {}, "optimizer": {}}

    def export_weights(self) -> dict[str, torch.Tensor]:
        weights = {}
        for name, param in trainable_parameters(self.module):
            full = full_tensor(param)  # collective for a sharded parameter: every rank takes part
            if self.owns_state:
                weights[name] = full
        return self._strip_prefix({"model": weights})["model"]

    def import_state(self, state: CanonicalState) -> None:
        import_module_state(self.module, self.optimizer, state, canonical=_canonical_name)

    @property
    def snapshot_is_sharded(self) -> bool:
        return self.layout.snapshots_are_sharded

    @property
    def snapshot_is_local(self) -> bool:
        # Without DTensor parameters every rank holds its stages' full tensors.
        return self.snapshot_is_sharded or (self.layout.tp == 1 and self.layout.ep == 1 and not (
            self.layout.dp > 1 and self.layout.data_parallel == "fsdp2"))

    def snapshot_state(self, into: CanonicalState | ShardedPart | None = None) -> CanonicalState | ShardedPart:
        if self.snapshot_is_sharded:
            return self.snapshot_source()(into)
        # Every rank keeps its stages' full state (gathered when sharded), so any survivor can restore them.
        reuse = self._add_prefix(into) if into else None
        return self._strip_prefix(export_module_state(self.module, self.optimizer, reuse))

    def snapshot_source(self):
        if not self.snapshot_is_sharded:
            return self.snapshot_state
        prefixed = LocalSources.of(self.module, self.optimizer)
        sources = LocalSources(self._strip_prefix({"model": prefixed.params})["model"],
                               self._strip_prefix({"optimizer": prefixed.adam})["optimizer"])
        return ShardCopy(layout=sources.layout,
                         copy=lambda into=None: sources.copy(into if isinstance(into, ShardedPart) else None))

    def _strip_prefix(self, state: CanonicalState) -> CanonicalState:
        return {section: {_canonical_name(name): v for name, v in part.items()} for section, part in state.items()}

    def _add_prefix(self, state: CanonicalState) -> CanonicalState:
        """`state`'s tensors under the ModuleList's names (those it has)."""
        prefixed: CanonicalState = {"model": {}, "optimizer": {}}
        for slot, stage in enumerate(self.stages):
            for name, _ in stage.named_parameters():
                if name not in state["model"]:
                    continue
                prefixed["model"][f"{slot}.{name}"] = state["model"][name]
                if name in state["optimizer"]:
                    prefixed["optimizer"][f"{slot}.{name}"] = state["optimizer"][name]
        return prefixed


def _canonical_name(name: str) -> str:
    """Names inside the ModuleList are "<stage slot>.<canonical name>"."""
    return name.split(".", 1)[1]
