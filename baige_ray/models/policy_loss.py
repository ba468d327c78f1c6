"""GRPO's pieces as pure tensor functions: group-relative advantages, token log-probabilities, the clipped
policy-gradient loss with an optional KL penalty to a reference policy.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, sec. 4.1):
each prompt is answered `group_size` times; a completion's advantage is its reward's distance from
its group's mean, in units of the group's standard deviation, and every token of the completion
carries it. The loss is PPO's clipped surrogate on the ratio of the policy's token probability to
the one that sampled it, plus `kl_coef` times the k3 estimate of KL(policy || reference) per token.

Tensors are batch-first: rewards (groups, group_size); per-token figures (sequences, tokens) with a
mask that is 1 on completion tokens and 0 on prompt and padding.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

AGGREGATIONS = ("sequence", "token")


@dataclasses.dataclass(kw_only=True, frozen=True)
class PolicyLossConfig:
    """`clip_low` / `clip_high`: the ratio is kept in [1 - clip_low, 1 + clip_high] (equal in PPO and
    GRPO; a larger `clip_high` is DAPO's clip-higher). `kl_coef`: the KL penalty's weight (0 leaves the
    reference model out). `scale_by_std`: divide advantages by the group's standard deviation (GRPO;
    Dr. GRPO leaves it out). `aggregate`: "sequence" averages each completion's tokens, then the
    completions (GRPO's 1/G sum 1/|o_i| sum_t); "token" averages every completion token of the batch
    (DAPO), so long completions weigh more."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    scale_by_std: bool = True
    aggregate: str = "sequence"

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_low < 1.0:
            raise ValueError(f"PolicyLossConfig.clip_low={self.clip_low!r} is invalid: expected 0 < clip_low < 1")
        if not self.clip_high > 0.0:
            raise ValueError(f"PolicyLossConfig.clip_high={self.clip_high!r} is invalid: expected > 0")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"PolicyLossConfig.kl_coef={self.kl_coef!r} is invalid: expected >= 0")
        if self.aggregate not in AGGREGATIONS:
            raise ValueError(f"PolicyLossConfig.aggregate={self.aggregate!r} is invalid: expected one of "
                             f"{', '.join(AGGREGATIONS)}")


def group_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """(groups, group_size) rewards -> advantages of the same shape: reward minus its group's mean,
    divided by the group's sample standard deviation plus `eps` when `scale_by_std`. A group whose
    completions all scored the same teaches nothing: its advantages are 0."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are invalid: expected (groups, group_size >= 2)")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under `logits` (sequences, tokens, vocab) for `tokens` (sequences, tokens), in fp32:
    the logits at position t scored against the token at t (shift before calling)."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) from samples of the policy: r - log r - 1 with
    r = p_ref / p (non-negative, unbiased; Schulman 2020, "Approximating KL Divergence")."""
    log_ratio = ref_log_probs - log_probs
    return torch.exp(log_ratio) - log_ratio - 1.0


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, config: PolicyLossConfig = PolicyLossConfig(),
                ref_log_probs: torch.Tensor | None = None,
                token_divisor: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate loss (to minimize) over completion tokens, and its statistics.

    `log_probs` (sequences, tokens) carry the gradient; `old_log_probs` are the sampling policy's (the
    same values, detached, on the first update of a batch: the ratio is then 1 and the gradient is
    advantage times the gradient of log p); `advantages` are per sequence (sequences,). `token_divisor`
    replaces the batch's own completion-token count in the "token" aggregate (the whole step's share of
    this batch, so that micro-batches and replicas add up to the step's token mean)."""
    if config.kl_coef > 0 and ref_log_probs is None:
        raise ValueError("policy_loss with kl_coef > 0 needs ref_log_probs (the reference model's)")
    mask = mask.to(log_probs.dtype)
    ratio = torch.exp(log_probs - old_log_probs.detach())
    advantage = advantages.detach().to(log_probs.dtype).unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if config.kl_coef > 0:
        kl = kl_k3(log_probs, ref_log_probs.detach())
        per_token = per_token + config.kl_coef * kl
    loss = _aggregate(per_token, mask, config.aggregate, token_divisor)
    tokens = mask.sum().clamp(min=1.0)
    clipping = (clipped < unclipped).to(mask.dtype)  # the clipped term is taken: no gradient through the ratio
    stats = {"clip_fraction": float((clipping * mask).sum() / tokens),
             "ratio_mean": float((ratio.detach() * mask).sum() / tokens)}
    if kl is not None:
        stats["kl"] = float((kl.detach() * mask).sum() / tokens)
    return loss, stats


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, token_divisor: float | None) -> torch.Tensor:
    if how == "token":
        divisor = mask.sum().clamp(min=1.0) if token_divisor is None else (token_divisor or 1.0)
        return (per_token * mask).sum() / divisor
    per_sequence = (per_token * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return per_sequence.mean()
