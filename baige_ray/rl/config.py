"""What a GRPO run is: its iterations, groups, sampling and optimizer, typed and checked on creation."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from baige_ray.api.validation import require_choice, require_int, require_number
from baige_ray.models.policy_loss import PolicyLossConfig


@dataclasses.dataclass(kw_only=True, frozen=True)
class GRPOConfig:
    """One iteration samples `group_size` completions of each of `prompts_per_iteration` prompts (the
    prompts in a seeded order, epoch after epoch), scores them, and takes `updates_per_iteration`
    optimizer steps on all of them (GRPO's mu: after the first, the policy has moved away from the one
    that sampled, and the ratio against the sampling engine's log-probabilities is what the clip bounds).
    A KL penalty (`loss.kl_coef` > 0) compares the policy with its starting weights, which a reference
    actor of the run holds.

    Completion i of prompt p in iteration t is sampled with seed `sample_seed(t, p, i)`, so a run is
    reproducible with its `seed`, and a request re-issued after a rollout replica died gets the tokens
    the first one would have got. `learning_rate` is constant; `grad_clip` 0 turns clipping off.

    `off_policy_lag` 1 samples iteration t + 1 while iteration t trains, from the weights iteration t - 1
    left (one-step off-policy, as asynchronous GRPO does): the rollout and the training overlap instead
    of taking turns; the loss's ratio is taken against the log-probabilities of the policy that sampled,
    which is one update behind. 0 (the default) samples each iteration from the weights the one before
    it trained."""

    num_iterations: int
    prompts_per_iteration: int
    group_size: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int | None = None
    updates_per_iteration: int = 1
    seed: int = 0
    loss: PolicyLossConfig = PolicyLossConfig()
    rollout_retry_s: float = 120.0  # a rollout request whose replica died is re-issued until this has passed
    refit_timeout_s: float = 120.0  # a weight sync that has not reached every rollout replica by then fails
    off_policy_lag: int = 0

    def __post_init__(self) -> None:
        for name in ("num_iterations", "prompts_per_iteration", "max_new_tokens", "updates_per_iteration"):
            require_int("GRPOConfig", name, getattr(self, name), minimum=1)
        require_int("GRPOConfig", "group_size", self.group_size, minimum=2)  # advantages compare within a group
        require_int("GRPOConfig", "seed", self.seed, minimum=0)
        require_int("GRPOConfig", "off_policy_lag", self.off_policy_lag, minimum=0)
        require_choice("GRPOConfig", "off_policy_lag", self.off_policy_lag, (0, 1))
        require_number("GRPOConfig", "temperature", self.temperature, minimum=0, exclusive_minimum=True)
        require_number("GRPOConfig", "learning_rate", self.learning_rate, minimum=0, exclusive_minimum=True)
        require_number("GRPOConfig", "weight_decay", self.weight_decay, minimum=0)
        require_number("GRPOConfig", "grad_clip", self.grad_clip, minimum=0)
        for name in ("refit_timeout_s", "rollout_retry_s"):
            require_number("GRPOConfig", name, getattr(self, name), minimum=0, exclusive_minimum=True)
        if self.micro_batch_size is not None:
            require_int("GRPOConfig", "micro_batch_size", self.micro_batch_size, minimum=1)
            if self.batch_size % self.micro_batch_size:
                raise ValueError(f"GRPOConfig.micro_batch_size={self.micro_batch_size!r} is invalid: expected a "
                                 f"divisor of the batch, prompts_per_iteration x group_size = {self.batch_size}")
        if not isinstance(self.loss, PolicyLossConfig):
            raise ValueError(f"GRPOConfig.loss={self.loss!r} is invalid: expected a PolicyLossConfig")

    @property
    def num_steps(self) -> int:
        """Optimizer steps of the whole run."""
        return self.num_iterations * self.updates_per_iteration

    @property
    def batch_size(self) -> int:
        """Completions per iteration: the training step's global batch."""
        return self.prompts_per_iteration * self.group_size

    def sample_seed(self, iteration: int, prompt: int, sample: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}:{iteration}:{prompt}:{sample}".encode(), digest_size=7).digest()
        return int.from_bytes(digest, "big")  # below 2**56: a valid seed for every engine

    def prompt_indices(self, iteration: int, num_prompts: int) -> list[int]:
        """The prompts of `iteration` out of `num_prompts`: consecutive positions of a seeded order of all
        of them, a new order each epoch."""
        per = self.prompts_per_iteration
        positions = range(iteration * per, (iteration + 1) * per)
        orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(num_prompts)
                  for epoch in {p // num_prompts for p in positions}}
        return [int(orders[p // num_prompts][p % num_prompts]) for p in positions]
