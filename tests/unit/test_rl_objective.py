"""Rollouts packed as samples (rl/objective.py), the GRPO objective the engines minimize on them, and the
board training workers read them from (actors/rollout_board.py)."""

from __future__ import annotations

import math

import pytest
import torch

from actors.rollout_board import RolloutBoard
from baige_ray.api.configs import TrainConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.gpt import GPTConfig
from baige_ray.models.policy_loss import PolicyLossConfig, policy_loss, token_log_probs
from baige_ray.rl.objective import PolicyObjective, pack_rollouts, packed_length, unpack_targets


def test_a_rollout_is_packed_as_next_token_targets_masked_to_its_completion():
    inputs, targets = pack_rollouts([[5, 6], [9]], [[7, 8, 3], [4, 4, 4, 4, 4, 4, 4]], [0.5, -1.0], seq_len=5)
    assert inputs.tolist() == [[5, 6, 7, 8, 3], [9, 4, 4, 4, 4]]
    packed = unpack_targets(targets)
    assert packed.tokens.tolist() == [[6, 7, 8, 3, 0], [4, 4, 4, 4, 4]]
    # the second completion is cut at 5 of its 7 tokens
    assert packed.mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert packed.advantage.tolist() == [0.5, -1.0]
    assert torch.isnan(packed.sampled).all() and torch.isnan(packed.reference).all()
    _, targets = pack_rollouts([[5, 6]], [[7, 8]], [0.5], seq_len=5, sampled_log_probs=[[-1.0, -2.0]],
                               ref_log_probs=[[-3.0, -4.0]])
    packed = unpack_targets(targets)
    assert packed.sampled[0, 1:3].tolist() == [-1.0, -2.0] and packed.reference[0, 1:3].tolist() == [-3.0, -4.0]
    assert torch.isnan(packed.sampled[0, 0]) and torch.isnan(packed.reference[0, 3:]).all()
    with pytest.raises(ValueError, match="1 log-probabilities for a completion of 2 tokens"):
        pack_rollouts([[5, 6]], [[7, 8]], [0.5], seq_len=5, ref_log_probs=[[-3.0]])
    with pytest.raises(ValueError, match="prompt of 5 tokens"):
        pack_rollouts([[1] * 5], [[2]], [0.0], seq_len=5)


def test_the_objective_is_the_clipped_loss_on_the_completion_tokens_and_splits_exactly_into_micro_batches():
    torch.manual_seed(0)
    prompts, completions = [[1, 2], [3], [4, 5, 6], [7]], [[8, 9], [10, 11, 12], [13], [14, 15]]
    advantages = [1.0, -0.5, 0.25, -0.75]
    inputs, targets = pack_rollouts(prompts, completions, advantages, seq_len=5)
    logits = torch.randn(4, 5, 16, requires_grad=True)
    objective = PolicyObjective()
    loss = objective.loss(logits, targets)
    packed = unpack_targets(targets)
    log_probs = token_log_probs(logits, packed.tokens)
    expected, _ = policy_loss(log_probs.detach(), log_probs.detach(), torch.tensor(advantages), packed.mask,
                              PolicyLossConfig())
    assert float(loss.detach()) == pytest.approx(float(expected))
    # One update per batch: the ratio is 1, so the loss is minus the mean over completions of the
    # advantage (a completion's tokens averaged).
    assert float(loss.detach()) == pytest.approx(-sum(advantages) / 4)
    (whole,) = torch.autograd.grad(loss, logits)
    halves = [objective.loss(logits[part], targets[part]) / 2 for part in (slice(0, 2), slice(2, 4))]
    (split,) = torch.autograd.grad(sum(halves), logits)
    torch.testing.assert_close(split, whole)  # what gradient accumulation over micro-batches computes


def test_rollouts_packed_as_long_as_the_longest_needs_give_the_same_loss_as_packed_to_seq_len():
    """A causal model's logits at a position never depend on later ones, and the columns past the last
    completion token carry no loss: the tight packing trains the same policy on fewer positions."""
    torch.manual_seed(0)
    prompts, completions = [[1, 2], [3], [4, 5, 6]], [[8, 9], [10, 11, 12, 13], [14]]
    assert packed_length(prompts, completions, seq_len=32, multiple=2) == 4  # 3 + 4 tokens: 4 inputs
    assert packed_length(prompts, completions, seq_len=32) == 8 and packed_length(prompts, completions, seq_len=3) == 3
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))  # position by position
    losses = []
    for length in (4, 12):
        inputs, targets = pack_rollouts(prompts, completions, [1.0, -0.5, 0.25], seq_len=length,
                                        sampled_log_probs=[[-1.0, -2.0], None, [-0.5]])
        losses.append(PolicyObjective().loss(model(inputs), targets))
    tight, full = (torch.autograd.grad(loss, model[1].weight)[0] for loss in losses)
    assert float(losses[0].detach()) == pytest.approx(float(losses[1].detach()))
    torch.testing.assert_close(tight, full)


def test_the_samplers_log_probabilities_set_the_ratio_where_given():
    logits = torch.zeros(1, 3, 4)  # every token 1/4
    objective = PolicyObjective(loss_config=PolicyLossConfig(clip_low=0.2, clip_high=0.2))
    _, targets = pack_rollouts([[1]], [[2, 3]], [1.0], seq_len=3, sampled_log_probs=[[math.log(0.5)] * 2])
    assert float(objective.loss(logits, targets)) == pytest.approx(-0.5)  # ratio 0.25 / 0.5 = 0.5 < 0.8: min keeps it
    _, targets = pack_rollouts([[1]], [[2, 3]], [1.0], seq_len=3, sampled_log_probs=[[math.log(0.125)] * 2])
    assert float(objective.loss(logits, targets)) == pytest.approx(-1.2)  # ratio 2 is clipped to 1.2


def test_the_kl_penalty_adds_the_k3_estimate_against_the_reference_log_probabilities():
    logits = torch.zeros(1, 3, 4)  # the policy: every token 1/4
    objective = PolicyObjective(loss_config=PolicyLossConfig(kl_coef=0.5))
    _, targets = pack_rollouts([[1]], [[2, 3]], [0.0], seq_len=3, ref_log_probs=[[math.log(0.5)] * 2])
    # advantage 0: only the penalty; r = p_ref / p = 2, k3 = r - log r - 1 = 1 - log 2 per token
    assert float(objective.loss(logits, targets)) == pytest.approx(0.5 * (1 - math.log(2)))
    _, without_reference = pack_rollouts([[1]], [[2, 3]], [0.0], seq_len=3)
    with pytest.raises(ValueError, match="no reference log-probabilities"):
        objective.loss(logits, without_reference)


def test_an_objective_is_checked_where_the_job_is_built():
    with pytest.raises(ValueError, match="PolicyObjective.loss_config"):
        PolicyObjective(loss_config="grpo")
    with pytest.raises(ValueError, match="TrainJob.objective"):
        TrainJob(model=GPTConfig(), train=TrainConfig(num_steps=1), objective="grpo")
    with pytest.raises(ValueError, match=r"targets of shape \(2, 3\)"):
        unpack_targets(torch.zeros(2, 3))


def test_the_board_serves_an_iterations_samples_by_global_index_and_keeps_the_first_and_newest():
    board = RolloutBoard(batch_size=2, keep=2)
    for iteration in range(4):
        board.publish(iteration, torch.full((2, 3), iteration), torch.full((2, 3, 5), float(iteration)))
    assert board.published() == [0, 2, 3]
    inputs, targets = board.batch([7, 4, 0])
    assert inputs[:, 0].tolist() == [3, 2, 0] and targets.shape == (3, 3, 5)
    with pytest.raises(KeyError, match="step 1"):
        board.batch([2])
    with pytest.raises(ValueError, match="batch size, 2"):
        board.publish(4, torch.zeros(3, 3), torch.zeros(3, 3, 5))


def test_a_grpo_config_names_what_is_wrong_and_orders_prompts_epoch_by_epoch():
    from baige_ray.rl.config import GRPOConfig

    with pytest.raises(ValueError, match="GRPOConfig.group_size"):
        GRPOConfig(num_iterations=1, prompts_per_iteration=2, group_size=1)
    with pytest.raises(ValueError, match="GRPOConfig.micro_batch_size=3"):
        GRPOConfig(num_iterations=1, prompts_per_iteration=2, group_size=4, micro_batch_size=3)
    with pytest.raises(ValueError, match="GRPOConfig.off_policy_lag=2"):
        GRPOConfig(num_iterations=1, prompts_per_iteration=2, off_policy_lag=2)
    config = GRPOConfig(num_iterations=4, prompts_per_iteration=3, seed=7)
    order = [config.prompt_indices(t, 6) for t in range(4)]
    assert sorted(order[0] + order[1]) == sorted(order[2] + order[3]) == list(range(6))  # every prompt once an epoch
    assert order[0] + order[1] != order[2] + order[3]  # in a new order
    assert order == [GRPOConfig(num_iterations=4, prompts_per_iteration=3, seed=7).prompt_indices(t, 6) for t in range(4)]
    seeds = {config.sample_seed(t, p, i) for t in range(3) for p in range(3) for i in range(4)}
    assert len(seeds) == 36 and max(seeds) < 2**56


def test_updates_per_iteration_multiply_the_steps_and_a_run_that_cannot_hold_its_devices_is_refused():
    from baige_ray.rl.config import GRPOConfig
    from baige_ray.rl.placement import check_devices, check_off_policy
    from baige_ray.rl.trainer import RolloutOptions

    assert GRPOConfig(num_iterations=5, prompts_per_iteration=2, updates_per_iteration=3).num_steps == 15
    with pytest.raises(ValueError, match="GRPOConfig.updates_per_iteration"):
        GRPOConfig(num_iterations=5, prompts_per_iteration=2, updates_per_iteration=0)
    with pytest.raises(ValueError, match="RolloutOptions.reference_device_share"):
        RolloutOptions(reference_device_share=1.5)
    check_devices({"rollout replicas": 1.5, "training workers": 2.0, "the reference policy": 0.5}, 4.0)
    check_off_policy(1, "split", sized=False)
    for placement, sized in (("colocated", False), ("split", True)):
        with pytest.raises(ValueError, match="GRPOConfig.off_policy_lag=1 is invalid with placement"):
            check_off_policy(1, placement, sized=sized)
    check_devices({"rollout replicas": 2.0, "training workers": 4.0}, 0.0)  # CPUs only: every part shares them
    with pytest.raises(ValueError, match=r"needs 5 devices \(rollout replicas 2, training workers 2, the reference "
                                         r"policy 1\) and the pool has 4"):
        check_devices({"rollout replicas": 2.0, "training workers": 2.0, "the reference policy": 1.0}, 4.0)


def test_a_colocated_run_pairs_each_worker_with_a_replica_on_one_device():
    from baige_ray.rl.placement import COLOCATED_SHARES, check_colocation, device_shares, shared_devices
    from baige_ray.rl.trainer import RolloutOptions

    shares = COLOCATED_SHARES
    assert shares.replica > 0.5 and shares.replica + shares.worker + shares.reference == pytest.approx(1.0)
    assert device_shares("split", replica=0.75, worker=1.0, reference=0.25).reference == 0.25
    assert device_shares("colocated", replica=1.0, worker=1.0, reference=1.0) == shares
    check_colocation("colocated", num_replicas=2, num_workers=2, num_spares=0)
    with pytest.raises(ValueError, match="RolloutOptions.num_replicas=1 is invalid with placement='colocated'"):
        check_colocation("colocated", num_replicas=1, num_workers=2, num_spares=0)
    with pytest.raises(ValueError, match="ElasticConfig.num_spares=1"):
        check_colocation("colocated", num_replicas=2, num_workers=2, num_spares=1)
    with pytest.raises(ValueError, match="RolloutOptions.engine='vllm' is invalid with placement='colocated'"):
        RolloutOptions(engine="vllm", placement="colocated")
    with pytest.raises(ValueError, match="RolloutOptions.placement"):
        RolloutOptions(placement="beside")
    assert shared_devices([("a", 0), ("a", 1)], [("a", 1), ("b", 0)]) == 1
