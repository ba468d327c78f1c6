"""Data parallelism by the real DeepSpeed engine, ZeRO stage 1, 2 or 3.

DeepSpeed joins the process group the worker already belongs to
(`dist_init_required=False`); on CPU its accelerator is "cpu" and its
collectives run on gloo. The client optimizer is the same AdamW with the same
parameter groups as every other engine, so the update is the same mathematics.
Gradient accumulation and clipping are DeepSpeed's own. With expert parallelism
(ZeRO-1/2), experts are sharded by expert index and their gradients and optimizer
state live in DeepSpeed's expert-data-parallel groups (deepspeed_experts.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from baige_ray.engines.base import Engine, SlowChipEmulator
from baige_ray.engines.layout import ParallelLayout
from baige_ray.engines.state import ADAM_KEYS, CanonicalState
from baige_ray.models.aux_loss import auxiliary_losses
from baige_ray.runtime.train_loop import TrainJob, build_optimizer


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
        import deepspeed

        # DeepSpeed reads these even when the process group exists; one device per worker process.
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(dist.get_rank()), str(dist.get_world_size())
        (model,) = self.build_stages()  # ZeRO needs no pipeline: one stage holds the whole model
        self._model = model
        self.emulators = [SlowChipEmulator(model, self.emulated_speed)]
        self.expert_layers = self.plugin.expert_modules(model)
        self.zero_stage = int(layout.data_parallel.removeprefix("zero"))
        self.expert_shards = self._shard_experts(model) if layout.ep > 1 else None
        self.engine, _, _, _ = deepspeed.initialize(
            model=self._deepspeed_view(model),
            optimizer=build_optimizer(model, job.train, regroup=self._optimizer_regroup()),
            config=deepspeed_config(job, self.per_replica_batch, self.zero_stage),
            dist_init_required=False,
        )
        if self.expert_shards is not None:
            self.expert_shards.check_same_expert_groups()

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

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        micro = self.job.train.micro_batch_size or self.per_replica_batch
        num_micro = self.per_replica_batch // micro
        losses = []
        # DeepSpeed scales the loss by 1 / gradient_accumulation_steps; auxiliary losses get the same weight.
        with auxiliary_losses(weight=1.0 / num_micro) as aux:
            for index in range(num_micro):
                chunk = slice(index * micro, (index + 1) * micro)
                loss = self.plugin.loss(self.engine(inputs[chunk].to(self.device)), targets[chunk].to(self.device))
                self.engine.backward(loss)
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
        state = self.snapshot_state()
        return state if self.owns_state else {"model": {}, "optimizer": {}}

    def export_weights(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        weights = {}
        for name, param in self.module.named_parameters():
            full = self._canonical(name, safe_get_full_fp32_param(param))  # collective under ZeRO-3
            if self.owns_state:
                weights[name] = full
        return weights

    def snapshot_state(self, into: CanonicalState | None = None) -> CanonicalState:
        """Collective: every rank gets the full fp32 weights and Adam moments (fresh tensors)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self._base_optimizer_states():
            self._relink_state_fragments()
        model, adam = {}, {}
        step = [s["step"] for s in self._base_optimizer_states()]
        for name, param in self.module.named_parameters():
            model[name] = self._canonical(name, safe_get_full_fp32_param(param))  # collective under ZeRO-3
            moments = {key: safe_get_full_optimizer_state(param, key) for key in ADAM_KEYS}
            if step and all(value is not None for value in moments.values()):
                adam[name] = {"step": torch.as_tensor(step[0], dtype=torch.float32).clone()}
                adam[name].update({key: self._canonical(name, value) for key, value in moments.items()})
        return {"model": model, "optimizer": adam}

    def _canonical(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A fresh full CPU copy: expert slices gathered over the expert group (collective)."""
        if self.expert_shards is not None:
            value = self.expert_shards.gather(name, value)
        return value.detach().cpu().clone()

    def _cut(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full if self.expert_shards is None else self.expert_shards.cut(name, full)

    def import_state(self, state: CanonicalState) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        self._load_weights(state["model"])
        if state["optimizer"]:
            self._create_optimizer_state()
            self._relink_state_fragments()
        for name, param in self.module.named_parameters():
            saved = state["optimizer"].get(name)
            if saved is not None:
                for key in ADAM_KEYS:
                    safe_set_full_optimizer_state(param, self._cut(name, saved[key]).to(self.device), key)
        steps = [saved["step"] for saved in state["optimizer"].values()]
        for base_state in self._base_optimizer_states():
            if steps:
                base_state["step"] = steps[0].clone() if torch.is_tensor(base_state["step"]) else int(steps[0])

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Set the model's weights and ZeRO's fp32 master partitions (re-derived from the weights in fp32,
        set from `weights` under bf16, whose copies are rounded)."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        for name, param in self.module.named_parameters():
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
        for name, param in self.module.named_parameters():
            safe_set_full_fp32_param(param, self._cut(name, weights[name]).to(self.device, torch.float32))
