"""Data-parallel SGD on the MLP regression task: the engine of the recovery benchmark.

Same contract as the GPT engines (index-addressed samples, a global batch that does
not depend on the data-parallel degree, canonical state), so the elastic controller
drives it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from baige_ray.engines.base import Engine, SlowChipEmulator
from baige_ray.engines.train_job import TrainJob, sample_range
from baige_ray.models.mlp import MLP, regression_batch
from baige_ray.parallel.distributed import all_reduce_abortable
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.state import CanonicalState, full_tensor

MOMENTUM_KEY = "momentum_buffer"


class MLPEngine(Engine):
    def __init__(self, job: TrainJob, layout: ParallelLayout, rank: int = 0, **options: Any):
        if layout.tp > 1 or layout.pp > 1 or layout.data_parallel != "ddp" or layout.dp_microbatches:
            raise ValueError(
                f"layout {layout.describe()} is invalid for the MLP: expected data parallel (ddp) with even shares"
            )
        super().__init__(job, layout, rank, **options)
        torch.manual_seed(job.train.seed)
        self.model = MLP(job.model).to(self.device)
        self.emulators = [SlowChipEmulator(self.model, self.emulated_speed)]
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=job.train.learning_rate, momentum=job.model.momentum, foreach=False
        )

    @property
    def module(self) -> nn.Module:
        return self.model

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = sample_range(step, self.coords.dp, self.layout.dp, self.job.train.global_batch_size)
        return regression_batch(self.job.model, indices, self.job.train.seed)

    def set_learning_rate(self, learning_rate: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, positions: None = None) -> float:
        outputs = self.model(inputs.to(self.device))
        loss = nn.functional.mse_loss(outputs, targets.to(self.device))
        loss.backward()
        if self.layout.dp > 1:
            self._average_gradients()
        return loss.item()

    def _average_gradients(self) -> None:
        # One flat all-reduce in parameter order: unlike DDP, whose buckets are laid out anew
        # in every new process group, the summation order never changes, so a run that
        # recovered onto a spare stays bitwise equal to one that never failed.
        grads = [param.grad for param in self.model.parameters()]
        flat = _flatten_dense_tensors(grads)
        all_reduce_abortable(flat)
        flat /= self.layout.dp
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def export_state(self) -> CanonicalState:
        return self.snapshot_state() if self.owns_state else {"model": {}, "optimizer": {}}

    @property
    def snapshot_is_local(self) -> bool:
        return True

    def snapshot_state(self, into: CanonicalState | None = None) -> CanonicalState:
        old_model, old_momentum = (into or {}).get("model", {}), (into or {}).get("optimizer", {})
        model, momentum = {}, {}
        for name, param in self.model.named_parameters():
            model[name] = full_tensor(param, old_model.get(name))
            buffer = self.optimizer.state.get(param, {}).get(MOMENTUM_KEY)
            if buffer is not None:
                old = old_momentum.get(name, {}).get(MOMENTUM_KEY)
                momentum[name] = {MOMENTUM_KEY: full_tensor(buffer, old)}
        return {"model": model, "optimizer": momentum}

    def import_state(self, state: CanonicalState) -> None:
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(state["model"][name].to(self.device))
                saved = state["optimizer"].get(name)
                if saved is not None:
                    self.optimizer.state[param] = {MOMENTUM_KEY: saved[MOMENTUM_KEY].to(self.device).clone()}
