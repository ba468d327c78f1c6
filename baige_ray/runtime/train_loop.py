"""One worker's share of a training step, identical whether run alone or under DDP.

A step covers global sample indices [step * B, (step + 1) * B); rank r of W
reads the contiguous slice r * B/W ... (r + 1) * B/W and splits it into
micro-batches. Gradients are averaged over micro-batches here and over ranks by
DDP, so every layout computes the same update as one process with batch B.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from baige_ray.api.configs import TrainConfig
from baige_ray.models.corpus import ByteCorpus, CorpusConfig, stdlib_corpus
from baige_ray.models.gpt import GPT, GPTConfig, language_model_loss


@dataclass(kw_only=True, frozen=True)
class TrainJob:
    """Everything a worker needs to build its trainer; small and picklable."""

    model: GPTConfig
    train: TrainConfig
    corpus: CorpusConfig = field(default_factory=CorpusConfig)


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


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    # Decay matrices only; biases, norms and embeddings' 1-D params stay undecayed (GPT-2 practice).
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(0.9, 0.95), foreach=False)


class Trainer:
    """Model, optimizer and data of one rank. `wrap` turns the model into its parallel form."""

    def __init__(
        self,
        job: TrainJob,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        corpus: ByteCorpus | None = None,
    ):
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.per_rank_batch = job.train.per_worker_batch(world_size)
        self.micro_batch_size = job.train.micro_batch_size or self.per_rank_batch
        self.corpus = corpus or stdlib_corpus(job.corpus)
        self.model = self._build_model()
        self.parallel_model = wrap(self.model) if wrap else self.model
        self.optimizer = build_optimizer(self.model, job.train)

    def _build_model(self) -> GPT:
        # The same seed on every rank gives identical initial weights without a broadcast.
        torch.manual_seed(self.job.train.seed)
        return GPT(self.job.model).to(self.device)

    def train_step(self, step: int) -> dict[str, float]:
        """Run one optimizer step; returns this rank's mean loss and its token count."""
        started = time.perf_counter()
        self.parallel_model.train()
        learning_rate = learning_rate_at(step, self.job.train)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        indices = sample_range(step, self.rank, self.world_size, self.job.train.global_batch_size)
        inputs, targets = self.corpus.batch(indices, self.job.model.seq_len, self.job.train.seed)
        loss_sum = self._accumulate_gradients(inputs.to(self.device), targets.to(self.device))
        if self.job.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "step": step,
            "loss": loss_sum,
            "learning_rate": learning_rate,
            "tokens": inputs.numel(),
            "compute_s": time.perf_counter() - started,
        }

    def _accumulate_gradients(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        num_micro = self.per_rank_batch // self.micro_batch_size
        loss_sum = 0.0
        for index in range(num_micro):
            chunk = slice(index * self.micro_batch_size, (index + 1) * self.micro_batch_size)
            # Only the last micro-batch synchronises gradients across ranks.
            sync = index == num_micro - 1
            with self._maybe_no_sync(sync):
                loss = language_model_loss(self.parallel_model(inputs[chunk]), targets[chunk]) / num_micro
                loss.backward()
            loss_sum += loss.item()
        return loss_sum

    def _maybe_no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        no_sync = getattr(self.parallel_model, "no_sync", None)
        return contextlib.nullcontext() if sync or no_sync is None else no_sync()

    def model_state(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().cpu().clone() for name, tensor in self.model.state_dict().items()}
