"""GRPO as a training objective the engines run in place of next-token cross entropy.

An engine computes `objective.loss(logits, targets)` wherever it would compute the model's loss (every
layout: DDP, FSDP2, ZeRO, TP, pipeline stages), so a policy trains in any layout the planner picks.
The rollouts reach it as ordinary (inputs, targets) samples: inputs are the prompt and completion's
tokens, right-padded; targets pack five figures per position (`TARGET_FIELDS`): the next token, whether
it is a completion token the loss counts, the completion's advantage, the log-probability the
sampling engine gave it (NaN where it reported none: the policy's own, detached, is used, which is
right for GRPO's first update on a batch only), and the reference policy's (NaN without a KL penalty).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from baige_ray.models.policy_loss import PolicyLossConfig, policy_loss, token_log_probs

TARGET_FIELDS = ("token", "mask", "advantage", "old_log_prob", "ref_log_prob")


@dataclasses.dataclass(kw_only=True, frozen=True)
class PolicyObjective:
    """The clipped policy-gradient loss of `PolicyLossConfig` on packed rollout targets; with `kl_coef` > 0
    the targets must carry the reference policy's log-probabilities on every completion token."""

    loss_config: PolicyLossConfig = PolicyLossConfig()

    def __post_init__(self) -> None:
        if not isinstance(self.loss_config, PolicyLossConfig):
            raise ValueError(f"PolicyObjective.loss_config={self.loss_config!r} is invalid: "
                             "expected a PolicyLossConfig")

    @property
    def normalises_by_tokens(self) -> bool:
        """The token mean (DAPO's "token" aggregate) is over the step's completion tokens, however the
        micro-batches and replicas split them; the sequence mean is a mean over samples already."""
        return self.loss_config.aggregate == "token"

    def trained_tokens(self, targets: torch.Tensor) -> int:
        return int(unpack_targets(targets).mask.sum())

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, tokens_per_sample: float | None = None) -> torch.Tensor:
        packed = unpack_targets(targets)
        log_probs = token_log_probs(logits, packed.tokens)
        old = torch.where(torch.isnan(packed.sampled), log_probs.detach(), packed.sampled)
        reference = None
        if self.loss_config.kl_coef > 0:
            if torch.isnan(packed.reference[packed.mask > 0]).any():
                raise ValueError("the rollouts carry no reference log-probabilities, which a KL penalty (kl_coef "
                                 f"{self.loss_config.kl_coef:g}) needs: pack them with ref_log_probs")
            reference = torch.nan_to_num(packed.reference)  # NaN off the completions, where the mask drops it
        divisor = None if tokens_per_sample is None else tokens_per_sample * targets.shape[0]
        loss, _ = policy_loss(log_probs, old, packed.advantage, packed.mask, self.loss_config, reference,
                              token_divisor=divisor)
        return loss


@dataclasses.dataclass(frozen=True)
class PackedTargets:
    tokens: torch.Tensor  # (sequences, tokens) int64: the next token
    mask: torch.Tensor  # 1 on the completion tokens the loss counts
    advantage: torch.Tensor  # (sequences,)
    sampled: torch.Tensor  # the sampling engine's log-probabilities (NaN where it gave none)
    reference: torch.Tensor  # the reference policy's (NaN without one)


def unpack_targets(targets: torch.Tensor) -> PackedTargets:
    """(sequences, tokens, 5) packed targets, as `pack_rollouts` makes them, field by field."""
    if targets.dim() != 3 or targets.shape[-1] != len(TARGET_FIELDS):
        raise ValueError(f"targets of shape {tuple(targets.shape)} are invalid: expected (sequences, tokens, "
                         f"{len(TARGET_FIELDS)}) packed rollouts (baige_ray.rl.objective.pack_rollouts)")
    tokens, mask, advantage, sampled, reference = targets.unbind(-1)
    return PackedTargets(tokens.long(), mask, advantage[:, 0], sampled, reference)


def pack_rollouts(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  advantages: Sequence[float], seq_len: int, *, pad_id: int = 0,
                  sampled_log_probs: Sequence[Sequence[float] | None] | None = None,
                  ref_log_probs: Sequence[Sequence[float]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples for the engines: inputs (n, seq_len) int64 and packed targets (n, seq_len, 5) float32.

    Sequence i is prompts[i] + completions[i], right-padded with `pad_id` to seq_len + 1 tokens (the
    causal model never attends to padding after a token, so none is masked); inputs are its first
    seq_len tokens, target tokens the last seq_len, and the mask is 1 where the target is a completion
    token. A completion that does not fit is cut, never the prompt. `sampled_log_probs` and
    `ref_log_probs` hold one figure per completion token (a completion's entry None: none reported)."""
    if not len(prompts) == len(completions) == len(advantages):
        raise ValueError(f"pack_rollouts got {len(prompts)} prompts, {len(completions)} completions and "
                         f"{len(advantages)} advantages: expected one of each per sample")
    inputs = torch.full((len(prompts), seq_len + 1), pad_id, dtype=torch.int64)
    targets = torch.zeros((len(prompts), seq_len, len(TARGET_FIELDS)), dtype=torch.float32)
    targets[..., 3:] = float("nan")
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        if len(prompt) >= seq_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens is invalid: expected fewer than seq_len={seq_len}")
        kept = list(completion)[: seq_len + 1 - len(prompt)]
        inputs[row, : len(prompt) + len(kept)] = torch.tensor(list(prompt) + kept, dtype=torch.int64)
        completion_targets = slice(len(prompt) - 1, len(prompt) - 1 + len(kept))
        targets[row, completion_targets, 1] = 1.0
        for field, figures in ((3, sampled_log_probs), (4, ref_log_probs)):
            if figures is not None and figures[row] is not None:
                targets[row, completion_targets, field] = _per_token(figures[row], len(completion))[: len(kept)]
    targets[..., 0] = inputs[:, 1:].float()
    targets[..., 2] = torch.tensor(list(advantages), dtype=torch.float32)[:, None]
    return inputs[:, :-1].contiguous(), targets


def packed_length(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], seq_len: int,
                  multiple: int = 8) -> int:
    """The positions the longest sample needs (its tokens but the last, which is only a target), rounded up
    to `multiple`, at most `seq_len`: packing to it drops only columns no completion token reaches, which
    the loss weighs zero and a causal model never lets earlier positions see."""
    longest = max(len(prompt) + len(completion) for prompt, completion in zip(prompts, completions)) - 1
    return min(seq_len, max(multiple, -(-longest // multiple) * multiple))


def _per_token(figures: Sequence[float], length: int) -> torch.Tensor:
    if len(figures) != length:
        raise ValueError(f"{len(figures)} log-probabilities for a completion of {length} tokens: expected one each")
    return torch.tensor(list(figures), dtype=torch.float32)
