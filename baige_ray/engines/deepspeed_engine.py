"""Data parallelism by the real DeepSpeed engine, ZeRO stage 1, 2 or 3.

DeepSpeed joins the process group the worker already belongs to
(`dist_init_required=False`); on CPU its accelerator is "cpu" and its
collectives run on gloo. The client optimizer is the same AdamW with the same
parameter groups as every other engine, so the update is the same mathematics.
Gradient accumulation and clipping are DeepSpeed's own. Frozen parameters (a LoRA
job's base weights, models/adapters.py) are DeepSpeed's to hold, partitioned under
ZeRO-3, but never stepped, snapshotted or exported: state is the trainable
parameters' alone, as in the other engines. With context parallelism (cp > 1) each rank
trains its part of every sequence (parallel/context_parallel.py) and ZeRO's data-parallel
group is all dp x cp ranks: weights, gradients and optimizer state are partitioned over
data x context ranks, as torchtitan shards them. With expert parallelism
(ZeRO-1/2), experts are sharded by expert index and their gradients and optimizer
state live in DeepSpeed's expert-data-parallel groups (deepspeed_experts.py).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from baige_ray.engines.base import Engine, SlowChipEmulator, document_positions
from baige_ray.engines.train_job import TrainJob, build_optimizer
from baige_ray.failpoints import BACKWARD, fail_point
from baige_ray.models.aux_loss import auxiliary_losses
from baige_ray.parallel.boxes import Box
from baige_ray.parallel.context_parallel import ContextParallel
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.shards import ShardCopy, ShardedPart, copy_local, meta_part
from baige_ray.parallel.state import ADAM_KEYS, CanonicalState, trainable_parameters


def deepspeed_config(job: TrainJob, per_replica_batch: int, zero_stage: int) -> dict:
    micro = job.train.micro_batch_size or per_replica_batch
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": per_replica_batch // micro,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": job.train.grad_clip,
        "steps_per_print": 2**31,
        "bf16": {"enabled": job.train.precision == "bf16-mixed"},
    }


class DeepSpeedEngine(Engine):
    def __init__(self, job: TrainJob, layout: ParallelLayout, rank: int = 0, **options: Any):
        super().__init__(job, layout, rank, **options)
        from baige_ray.engines.deepspeed_init import initialize

        # DeepSpeed reads these even when the process group exists; one device per worker process.
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(dist.get_rank()), str(dist.get_world_size())
        (model,) = self.build_stages()  # ZeRO needs no pipeline: one stage holds the whole model
        self.context_parallel = self._build_context_parallel(model)
        if layout.recompute == "full":
            from baige_ray.engines.parallelize import apply_activation_recomputation

            self.check_recomputation([model])
            apply_activation_recomputation(self.plugin.stage_blocks(model))
        self._model = model
        self.emulators = [SlowChipEmulator(model, self.emulated_speed)]
        self.expert_layers = self.plugin.expert_modules(model)
        self.zero_stage = int(layout.data_parallel.removeprefix("zero"))
        self.expert_shards = self._shard_experts(model) if layout.ep > 1 else None
        self._boxes: dict[str, Box] | None = None  # where this rank's ZeRO-3 partitions sit (_local_boxes)
        self.engine, _, _, _ = initialize(
            model=self._deepspeed_view(model),
            optimizer=build_optimizer(model, job.train, regroup=self._optimizer_regroup()),
            config=deepspeed_config(job, self.per_replica_batch, self.zero_stage),
            dist_init_required=False,
        )
        if self.expert_shards is not None:
            self.expert_shards.check_same_expert_groups()

    def _build_context_parallel(self, model: nn.Module) -> ContextParallel | None:
        if self.layout.cp == 1:
            return None
        from baige_ray.engines.parallelize import sliced_meshes

        self.plugin.enable_context_parallel(model)
        return self.build_context_parallel(
            sliced_meshes(self.device.type, {"dp": self.layout.dp, "cp": self.layout.cp})["cp"].get_group())

    def _shard_experts(self, model: nn.Module):
        from baige_ray.engines.deepspeed_experts import ExpertShards
        from baige_ray.engines.parallelize import sliced_meshes

        meshes = sliced_meshes(self.device.type, {"edp": self.layout.dp // self.layout.ep, "ep": self.layout.ep})
        return ExpertShards(model, self.expert_layers, meshes["ep"])

    def _deepspeed_view(self, model: nn.Module) -> nn.Module:
        if self.expert_shards is None:
            return model
        from baige_ray.engines.deepspeed_experts import ExpertGroups, WithExpertGroups

        return WithExpertGroups(model, ExpertGroups(self.expert_layers[0].num_experts, self.layout.ep))

    def _optimizer_regroup(self):
        if self.expert_shards is None:
            return None
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        return split_params_into_different_moe_groups_for_optimizer

    @property
    def module(self) -> nn.Module:
        return self._model

    def set_learning_rate(self, learning_rate: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = learning_rate

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         positions: torch.Tensor | None = None) -> float:
        if self.context_parallel is None:
            return self._accumulate(inputs, targets, positions)
        # This rank's part of every sequence, its loss its tokens' share of the replica's. DeepSpeed averages
        # gradients over all dp x cp ranks, so each share weighs cp times to sum over the CP group.
        return self.on_local_tokens(inputs, targets, positions, functools.partial(
            self._accumulate, gradient_weight=self.layout.cp))

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
                    gradient_weight: float = 1.0) -> float:
        micro = self.job.train.micro_batch_size or self.per_replica_batch
        num_micro = self.per_replica_batch // micro
        losses = []
        # DeepSpeed scales the loss by 1 / gradient_accumulation_steps; auxiliary losses get the same weight,
        # and the same `gradient_weight` (their gradient is added as it is, not through the scaled loss).
        with auxiliary_losses(weight=gradient_weight / num_micro) as aux:
            for index in range(num_micro):
                chunk = slice(index * micro, (index + 1) * micro)
                logits = self.engine(inputs[chunk].to(self.device), **document_positions(positions, chunk, self.device))
                loss = self.loss(logits, targets[chunk].to(self.device))
                fail_point(BACKWARD)
                self.engine.backward(loss * gradient_weight)
                if index < num_micro - 1:
                    self.engine.step()  # a micro-step: DeepSpeed only accumulates here
                losses.append(loss.item())
        return (sum(losses) + aux.total) / num_micro

    def optimizer_step(self) -> None:
        self.engine.step()  # the accumulation boundary: reduce, clip, update

    def _base_optimizer_states(self) -> list[dict]:
        return [state for state in self.engine.optimizer.optimizer.state.values() if state]

    def _flat_partitions(self) -> list[torch.Tensor]:
        """The fp32 partitions the base optimizer steps; ZeRO attaches them to its param groups only mid-step."""
        optimizer = self.engine.optimizer
        if self.zero_stage == 3:
            return list(optimizer.fp32_partitioned_groups_flat)
        return list(optimizer.single_partition_of_fp32_groups)

    def _create_optimizer_state(self) -> None:
        """Zero Adam moments for every flat partition, as AdamW's first step would create them."""
        base = self.engine.optimizer.optimizer
        for flat in self._flat_partitions():
            if not base.state.get(flat):
                base.state[flat] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    **{key: torch.zeros_like(flat) for key in ADAM_KEYS},
                }

    def _relink_state_fragments(self) -> None:
        # ZeRO-1/2 link each parameter to its slice of the Adam moments right after the
        # first parameter group's first step, before later groups have any state; relinking
        # once every group has state makes the per-parameter accessors see all of it.
        optimizer = self.engine.optimizer
        if hasattr(optimizer, "_hp_optimizer_states_linked"):
            optimizer._hp_optimizer_states_linked = False
            optimizer._lazy_init_hp_params_optimizer_state()

    def export_state(self) -> CanonicalState:
        state = self._gathered_state()
        return state if self.owns_state else {"model": {}, "optimizer": {}}

    def export_weights(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        weights = {}
        for name, param in trainable_parameters(self.module):
            full = self._canonical(name, safe_get_full_fp32_param(param))  # collective under ZeRO-3
            if self.owns_state:
                weights[name] = full
        return weights

    @property
    def snapshot_is_sharded(self) -> bool:
        # ZeRO-3 keeps 1/dp of every fp32 master and Adam moment here: the pieces are snapshotted, not dp
        # gathered copies. ZeRO-1/2 (full weights on every rank) and expert parallelism keep the gathered path.
        return self.layout.snapshots_are_sharded

    @property
    def snapshot_is_local(self) -> bool:
        return self.snapshot_is_sharded

    def snapshot_state(self, into: CanonicalState | ShardedPart | None = None) -> CanonicalState | ShardedPart:
        """This rank's pieces when sharded (no communication); otherwise the gathered state (collective)."""
        if self.snapshot_is_sharded:
            return self._local_part(into if isinstance(into, ShardedPart) else None)
        return self._gathered_state()

    def _gathered_state(self) -> CanonicalState:
        """Collective: every rank gets the full fp32 weights and Adam moments (fresh tensors)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self._base_optimizer_states():
            self._relink_state_fragments()
        model, adam = {}, {}
        step = [s["step"] for s in self._base_optimizer_states()]
        for name, param in trainable_parameters(self.module):
            model[name] = self._canonical(name, safe_get_full_fp32_param(param))  # collective under ZeRO-3
            moments = {key: safe_get_full_optimizer_state(param, key) for key in ADAM_KEYS}
            if step and all(value is not None for value in moments.values()):
                adam[name] = {"step": torch.as_tensor(step[0], dtype=torch.float32).clone()}
                adam[name].update({key: self._canonical(name, value) for key, value in moments.items()})
        return {"model": model, "optimizer": adam}

    def snapshot_source(self):
        if not self.snapshot_is_sharded:
            return self.snapshot_state
        return ShardCopy(layout=self._local_layout, copy=self._local_part)

    def _local_layout(self) -> ShardedPart:
        """The shapes `_local_part` copies (fp32 slices, a scalar step), as meta tensors."""
        boxes = self._local_boxes()
        slices = {name: torch.empty(box.size, dtype=torch.float32, device="meta") for name, box in boxes.items()}
        adam = {}
        if self._base_optimizer_states():
            adam = {name: {"step": torch.empty((), dtype=torch.float32, device="meta"),
                           **{key: piece for key in ADAM_KEYS}} for name, piece in slices.items()}
        return meta_part({"model": slices, "optimizer": adam}, boxes)

    def _local_part(self, into: ShardedPart | None = None) -> ShardedPart:
        """This rank's slices of the flattened fp32 masters and Adam moments, with no communication.

        ZeRO-3 cuts each parameter flattened and padded to a multiple of its partition group's size into
        equal contiguous partitions, rank r holding [r * n, (r + 1) * n) with n = ceil(numel / size): the
        padding past numel (the last ranks' tails, or a whole partition of a tiny parameter) is dropped.
        `into`, an earlier part of the same names, is written over instead of allocating.
        """
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        boxes = self._local_boxes()
        old_model = into.state["model"] if into is not None else {}
        old_adam = into.state["optimizer"] if into is not None else {}
        base_states = self._base_optimizer_states()
        model, adam = {}, {}
        for name, param in trainable_parameters(self.module):
            length = boxes[name].size[0]
            model[name] = copy_local(self._trim(param, safe_get_local_fp32_param(param), length), old_model.get(name))
            if base_states:
                old = old_adam.get(name, {})
                step = torch.as_tensor(base_states[0]["step"], dtype=torch.float32)
                adam[name] = {"step": copy_local(step, old.get("step"))}
                adam[name].update({
                    key: copy_local(self._trim(param, safe_get_local_optimizer_state(param, key), length), old.get(key))
                    for key in ADAM_KEYS})
        return ShardedPart({"model": model, "optimizer": adam}, dict(boxes))

    def _local_boxes(self) -> dict[str, Box]:
        """Where this rank's partition of each parameter sits in its flattened full tensor (fixed for the
        engine's life: computed once, from DeepSpeed's own partitioning rule in partition_parameters.py)."""
        if self._boxes is None:
            import deepspeed.comm as ds_dist

            boxes = {}
            for name, param in trainable_parameters(self.module):
                per_rank = param.ds_tensor.ds_numel  # ceil(ds_numel / group size): the padded partition
                start = per_rank * ds_dist.get_rank(group=param.ds_process_group)
                length = max(0, min(per_rank, param.ds_numel - start))
                boxes[name] = Box(tuple(param.ds_shape), (min(start, param.ds_numel),), (length,), flat=True)
            self._boxes = boxes
        return self._boxes

    @staticmethod
    def _trim(param: nn.Parameter, local: torch.Tensor | None, length: int) -> torch.Tensor:
        if local is None:
            raise ValueError(f"ZeRO-3 keeps no fp32 partition of a frozen parameter ({tuple(param.ds_shape)})")
        if local.numel() != param.ds_tensor.ds_numel:
            raise RuntimeError(f"a local ZeRO-3 partition of {local.numel()} elements, not {param.ds_tensor.ds_numel}")
        return local.narrow(0, 0, length)

    def _canonical(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A fresh full CPU copy: expert slices gathered over the expert group (collective)."""
        if self.expert_shards is not None:
            value = self.expert_shards.gather(name, value)
        return value.detach().cpu().clone()

    def _cut(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full if self.expert_shards is None else self.expert_shards.cut(name, full)

    def import_state(self, state: CanonicalState) -> None:
        self._load_weights(state["model"])
        if state["optimizer"]:
            self._create_optimizer_state()
            self._relink_state_fragments()
        for name, param in trainable_parameters(self.module):
            saved = state["optimizer"].get(name)
            if saved is not None:
                for key in ADAM_KEYS:
                    self._set_master(name, param, saved[key], key)
        first = next(iter(state["optimizer"]), None)  # every parameter's Adam has taken the same steps
        step = state["optimizer"][first]["step"] if first is not None else None
        for base_state in self._base_optimizer_states():
            if step is not None:
                base_state["step"] = step.clone() if torch.is_tensor(base_state["step"]) else int(step)

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Set the model's weights and ZeRO's fp32 master partitions (re-derived from the weights in fp32,
        set from `weights` under bf16, whose copies are rounded)."""
        import deepspeed

        for name, param in trainable_parameters(self.module):
            full = self._cut(name, weights[name]).to(self.device)
            if self.zero_stage == 3:
                # Every rank holds the full tensor, so rank 0's copy is what gets re-partitioned.
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    param.data.copy_(full)
            else:
                param.data.copy_(full)
        if self.job.train.precision != "bf16-mixed":
            self.engine.optimizer.refresh_fp32_params()
            return
        # the bf16 weights just copied are rounded: the fp32 masters take the full-precision values
        for name, param in trainable_parameters(self.module):
            self._set_master(name, param, weights[name])

    def _set_master(self, name: str, param: nn.Parameter, full: torch.Tensor, key: str | None = None) -> None:
        """Set this rank's part of a parameter's fp32 master (`key` None) or Adam moment from its full tensor.

        Under ZeRO-3 the part is written locally, padded to the partition: DeepSpeed's full setter narrows
        past the end of a tensor whose size its partition group does not divide (the last rank's padding).
        """
        from deepspeed.utils import (
            safe_set_full_fp32_param,
            safe_set_full_optimizer_state,
            safe_set_local_fp32_param,
            safe_set_local_optimizer_state,
        )

        full = self._cut(name, full)
        if self.zero_stage == 3:
            box = self._local_boxes()[name]
            piece = torch.zeros(param.ds_tensor.ds_numel, dtype=torch.float32, device=self.device)
            piece[:box.size[0]] = full.reshape(-1).narrow(0, box.start[0], box.size[0])
            if key is None:
                safe_set_local_fp32_param(param, piece)
            else:
                safe_set_local_optimizer_state(param, piece, key)
        elif key is None:
            safe_set_full_fp32_param(param, full.to(self.device, torch.float32))
        else:
            safe_set_full_optimizer_state(param, full.to(self.device, torch.float32), key)
