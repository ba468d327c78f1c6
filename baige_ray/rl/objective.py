"""GRPO as a training objective the engines run in place of next-token cross entropy.

An engine computes `objective.loss(logits, targets)` wherever it would compute the model's loss (every
layout: DDP, FSDP2, ZeRO, TP, pipeline stages), so a policy trains in any layout the planner picks.
The rollouts reach it as ordinary (inputs, targets) samples: inputs are the prompt and completion's
tokens, right-padded; targets pack four figures per position (`TARGET_FIELDS`): the next token, whether
it is a completion token the loss counts, the completion's advantage, and the log-probability the
sampling policy gave it (NaN where the sampler did not report one: the policy's own, detached, is
used, which is GRPO's single update per batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from baige_ray.models.policy_loss import PolicyLossConfig, policy_loss, token_log_probs

TARGET_FIELDS = ("token", "mask", "advantage", "old_log_prob")


@dataclasses.dataclass(kw_only=True, frozen=True)
class PolicyObjective:
    """The clipped policy-gradient loss of `PolicyLossConfig` on packed rollout targets. Without a KL
    term (`kl_coef` 0): a reference model's log-probabilities would be a fifth field."""

    loss_config: PolicyLossConfig = PolicyLossConfig()

    def __post_init__(self) -> None:
        if not isinstance(self.loss_config, PolicyLossConfig):
            raise ValueError(f"PolicyObjective.loss_config={self.loss_config!r} is invalid: "
                             "expected a PolicyLossConfig")
        if self.loss_config.kl_coef > 0:
            raise ValueError(f"PolicyObjective.loss_config.kl_coef={self.loss_config.kl_coef!r} is invalid: a KL "
                             "penalty needs a reference model, which the trainer does not run yet; expected 0")

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tokens, mask, advantage, sampled = unpack_targets(targets)
        log_probs = token_log_probs(logits, tokens)
        old = torch.where(torch.isnan(sampled), log_probs.detach(), sampled)
        loss, _ = policy_loss(log_probs, old, advantage, mask, self.loss_config)
        return loss


def unpack_targets(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequences, tokens, 4) packed targets -> next tokens (int64), mask, per-sequence advantages
    (sequences,) and the sampler's log-probabilities."""
    if targets.dim() != 3 or targets.shape[-1] != len(TARGET_FIELDS):
        raise ValueError(f"targets of shape {tuple(targets.shape)} are invalid: expected (sequences, tokens, "
                         f"{len(TARGET_FIELDS)}) packed rollouts (baige_ray.rl.objective.pack_rollouts)")
    tokens, mask, advantage, sampled = targets.unbind(-1)
    return tokens.long(), mask, advantage[:, 0], sampled


def pack_rollouts(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  advantages: Sequence[float], seq_len: int, *, pad_id: int = 0,
                  sampled_log_probs: Sequence[Sequence[float]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples for the engines: inputs (n, seq_len) int64 and packed targets (n, seq_len, 4) float32.

    Sequence i is prompts[i] + completions[i], right-padded with `pad_id` to seq_len + 1 tokens (the
    causal model never attends to padding after a token, so none is masked); inputs are its first
    seq_len tokens, target tokens the last seq_len, and the mask is 1 where the target is a completion
    token. A completion that does not fit is cut, never the prompt."""
    if not len(prompts) == len(completions) == len(advantages):
        raise ValueError(f"pack_rollouts got {len(prompts)} prompts, {len(completions)} completions and "
                         f"{len(advantages)} advantages: expected one of each per sample")
    inputs = torch.full((len(prompts), seq_len + 1), pad_id, dtype=torch.int64)
    targets = torch.zeros((len(prompts), seq_len, len(TARGET_FIELDS)), dtype=torch.float32)
    targets[..., 3] = float("nan")
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        if len(prompt) >= seq_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens is invalid: expected fewer than seq_len={seq_len}")
        kept = list(completion)[: seq_len + 1 - len(prompt)]
        inputs[row, : len(prompt) + len(kept)] = torch.tensor(list(prompt) + kept, dtype=torch.int64)
        completion_targets = slice(len(prompt) - 1, len(prompt) - 1 + len(kept))
        targets[row, completion_targets, 1] = 1.0
        if sampled_log_probs is not None:
            targets[row, completion_targets, 3] = torch.tensor(list(sampled_log_probs[row])[: len(kept)])
    targets[..., 0] = inputs[:, 1:].float()
    targets[..., 2] = torch.tensor(list(advantages), dtype=torch.float32)[:, None]
    return inputs[:, :-1].contiguous(), targets
