"""The mathematics of a training step that every engine and layout shares.

A step covers global sample indices [step * B, (step + 1) * B); data-parallel
replica r of R reads the contiguous slice r * B/R ... (r + 1) * B/R and splits
it into micro-batches. Gradients are averaged over micro-batches and replicas,
so every layout computes the same update as one process with batch B. Replicas on
chips of different speeds may hold uneven slices (`ParallelLayout.dp_microbatches`);
each micro-batch's loss is then weighted by R / (B / micro) instead of 1 / its
replica's micro-batch count, so the average over replicas is still the batch mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from baige_ray.api.configs import TrainConfig
from baige_ray.models.adapters import check_adapter, save_adapter
from baige_ray.models.plugin import ModelPlugin, PolicySamples, ProvidedSamples, SampleSource, plugin_for


@dataclass(kw_only=True, frozen=True)
class TrainJob:
    """Everything a worker needs to build its trainer; small and picklable.

    `model` is any registered model config (GPTConfig, HFModel, MLPConfig, ...); `data` what its
    plug-in trains on (a CorpusConfig, a TokenDataset; None for the plug-in's default data) or samples
    that bring their own source (`ProvidedSamples`: the rollouts a policy trainer publishes; `PolicySamples`:
    rollouts each rank draws from its own weights);
    `objective` replaces the model's next-token loss: anything with `loss(logits, targets)` that is
    small and picklable (rl.PolicyObjective); `adapter` a `peft.LoraConfig`: only its LoRA matrices
    train, the model's own weights stay frozen (models/adapters.py)."""

    model: Any
    train: TrainConfig
    data: Any = None
    objective: Any = None
    adapter: Any = None

    def __post_init__(self) -> None:
        plugin = plugin_for(self.model)  # an unknown model fails here, on the driver, naming the supported ones
        if self.adapter is not None:
            check_adapter(self.adapter)
            if not plugin.supports_adapters:
                raise ValueError(f"adapter= is invalid for {plugin.describe()}: adapters train Hugging Face models "
                                 "(HFModel)")
        if getattr(self.data, "packs_documents", False) and not plugin.supports_packed_documents:
            raise ValueError(f"TrainJob.data packs several documents per sequence, which {plugin.describe()} "
                             "cannot keep apart (its stages take no positions): build the data without packing")
        if self.objective is not None and not callable(getattr(type(self.objective), "loss", None)):
            raise ValueError(f"TrainJob.objective={self.objective!r} is invalid: expected an object with a "
                             "loss(logits, targets) method")

    @property
    def plugin(self) -> ModelPlugin:
        return plugin_for(self.model)

    def open_data(self) -> SampleSource | PolicySamples | None:
        """The samples the job trains on: `data` itself where it is a sample source of its own, else what
        the model's plug-in opens from it (checked against the model there)."""
        if isinstance(self.data, (ProvidedSamples, PolicySamples)):
            return self.data
        return self.plugin.open_data(self.data)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor,
             tokens_per_sample: float | None = None) -> torch.Tensor:
        """What every engine minimizes: the objective's loss, or the model's own (see ModelPlugin.loss for
        `tokens_per_sample`; an objective that averages otherwise is given None)."""
        if self.objective is not None:
            if not self.normalises_by_tokens:
                return self.objective.loss(logits, targets)
            return self.objective.loss(logits, targets, tokens_per_sample)
        return self.plugin.loss(logits, targets, tokens_per_sample)

    @property
    def normalises_by_tokens(self) -> bool:
        """Whether the loss is a mean over the step's trained tokens (then normalised by their global count)."""
        if self.objective is not None:
            return bool(getattr(self.objective, "normalises_by_tokens", False))
        return True

    def save_final(self, directory: Path, weights: dict[str, torch.Tensor], *, step: int) -> Path:
        """The final checkpoint of `weights` (the trained parameters by canonical name): the model's own
        directory, or with an adapter a PEFT adapter directory over the model's."""
        if self.adapter is not None:
            return save_adapter(directory, weights, self.adapter, base_model=str(self.model.path))
        return self.plugin.save_final(directory, weights, step=step)

    def trained_tokens(self, targets: torch.Tensor) -> int:
        """How many tokens of `targets` the loss trains."""
        owner = self.objective if self.objective is not None else self.plugin
        return owner.trained_tokens(targets)


def learning_rate_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_learning_rate at the last step."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    decay_steps = max(1, config.num_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_learning_rate + cosine * (config.learning_rate - config.min_learning_rate)


def sample_range(step: int, rank: int, world_size: int, global_batch_size: int) -> range:
    per_rank = global_batch_size // world_size
    start = step * global_batch_size + rank * per_rank
    return range(start, start + per_rank)


def replica_sample_range(step: int, replica: int, replica_batches: Sequence[int]) -> range:
    """The global batch's samples one data-parallel replica trains, replicas holding consecutive, possibly uneven parts."""
    start = step * sum(replica_batches) + sum(replica_batches[:replica])
    return range(start, start + replica_batches[replica])


def build_optimizer(model: nn.Module, config: TrainConfig,
                    regroup: Callable[[list[dict]], list[dict]] | None = None) -> torch.optim.Optimizer:
    """AdamW over two named parameter groups; `regroup` may split them further (DeepSpeed's expert groups)."""
    # Decay matrices only; biases, norms and embeddings' 1-D params stay undecayed (GPT-2 practice).
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"name": "decay", "params": decay, "weight_decay": config.weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    if regroup is not None:
        groups = regroup(groups)
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(0.9, 0.95), **_update_kernels(model))


def _update_kernels(model: nn.Module) -> dict:
    """On CUDA one fused kernel updates every tensor (torchtitan's default; a launch per parameter per
    operation otherwise); elsewhere a loop per parameter, which holds no temporaries the size of the model."""
    on_cuda = all(p.device.type == "cuda" for p in model.parameters())
    return {"fused": True} if on_cuda else {"foreach": False}
