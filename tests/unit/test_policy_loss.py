"""GRPO's advantages, log-probabilities, KL estimate and clipped loss (models/policy_loss.py) against
hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from baige_ray.models.policy_loss import (
    PolicyLossConfig,
    group_advantages,
    kl_k3,
    policy_loss,
    token_log_probs,
)


def test_advantages_are_rewards_in_units_of_their_groups_spread():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 1.0, 2.0, 2.0]])
    advantages = group_advantages(rewards, eps=1e-12)
    # group 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    assert advantages[0].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], rel=1e-4)
    assert advantages[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # every answer scored alike: nothing to learn
    # group 3: mean 2, sample std sqrt(2 / 3) = 0.81650
    assert advantages[2].tolist() == pytest.approx([1 / 0.8165, -1 / 0.8165, 0.0, 0.0], rel=1e-4)
    assert group_advantages(rewards, scale_by_std=False)[2].tolist() == [1.0, -1.0, 0.0, 0.0]


def test_token_log_probs_score_each_position_against_its_token():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    tokens = torch.tensor([[1, 2]])
    torch.testing.assert_close(token_log_probs(logits, tokens), torch.log(torch.tensor([[0.25, 0.8]])))


def test_kl_k3_of_a_halved_probability():
    log_probs, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_k3(log_probs, ref).item() == pytest.approx(0.5 + math.log(2) - 1)  # r - log r - 1, r = 1/2
    assert kl_k3(ref, ref).item() == 0.0


def test_on_policy_loss_is_advantage_weighted_log_likelihood():
    # two completions of 2 and 1 tokens (the third position is padding), advantages +1 and -2
    log_probs = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.2, 0.9, 0.9]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages = torch.tensor([1.0, -2.0])
    loss, stats = policy_loss(log_probs, log_probs.detach(), advantages, mask)
    # ratio 1 everywhere: per token -A; per sequence mean: -1 and +2; mean over sequences 0.5
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    # d loss / d log p = -A / |o_i| / G on completion tokens, 0 elsewhere
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.25, -0.25, 0.0], [1.0, 0.0, 0.0]]))
    assert stats["clip_fraction"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)


def test_token_aggregation_weighs_every_completion_token_alike():
    log_probs = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _ = policy_loss(log_probs, log_probs.detach(), torch.tensor([1.0, -2.0]), mask,
                          PolicyLossConfig(aggregate="token"))
    assert loss.item() == pytest.approx((-1 - 1 + 2) / 3)


def test_ratios_outside_the_clip_range_stop_the_gradient_in_the_direction_of_the_advantage():
    old = torch.log(torch.tensor([[0.4, 0.4, 0.4, 0.4]]).expand(4, 4).clone())
    new = torch.log(torch.tensor([0.6, 0.2, 0.6, 0.2])).unsqueeze(-1).expand(4, 4).clone().requires_grad_()
    # ratios 1.5, 0.5, 1.5, 0.5 against advantages +1, -1, -1, +1
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    loss, stats = policy_loss(new, old, advantages, torch.ones(4, 4))
    # per token -min(r A, clip(r) A): -1.2 (clipped), +0.8 (clipped), +1.5, -0.5
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5 - 0.5) / 4)
    loss.backward()
    grads = new.grad[:, 0].tolist()
    assert grads[0] == 0.0 and grads[1] == 0.0  # gains beyond the range are not pursued
    assert grads[2] == pytest.approx(1.5 / 4 / 4) and grads[3] == pytest.approx(-0.5 / 4 / 4)
    assert stats["clip_fraction"] == pytest.approx(0.5)


def test_kl_penalty_adds_its_weighted_estimate():
    log_probs = torch.full((1, 2), math.log(0.5), requires_grad=True)
    ref = torch.full((1, 2), math.log(0.25))
    config = PolicyLossConfig(kl_coef=0.1)
    loss, stats = policy_loss(log_probs, log_probs.detach(), torch.tensor([0.0]), torch.ones(1, 2), config, ref)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    assert stats["kl"] == pytest.approx(0.5 + math.log(2) - 1)
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss(log_probs, log_probs.detach(), torch.tensor([0.0]), torch.ones(1, 2), config)


def test_invalid_configs_name_the_field():
    for field, value in (("clip_low", 1.0), ("clip_high", 0.0), ("kl_coef", -0.1), ("aggregate", "batch")):
        with pytest.raises(ValueError, match=f"PolicyLossConfig.{field}"):
            PolicyLossConfig(**{field: value})
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.ones(3, 1))
