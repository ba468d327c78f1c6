"""GRPO in the shared pool (rl/trainer.py): rollouts on two serving replicas, the policy trained as an
elastic job (two updates per batch, a KL penalty to the starting weights held by a reference actor),
its weights into the replicas in memory after every iteration; a trainer worker SIGKILLed mid-step and
a rollout replica SIGKILLed mid-batch leave the run exactly where the fault-free one is. The fault-free
run places replicas and workers on devices of their own, the faulted one on the same devices in turns."""

from __future__ import annotations

import math

import pytest
import ray
import torch

from baige_ray.api.configs import RunConfig, ScalingConfig
from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.faults import FaultPlan
from baige_ray.models.hf import HFModel
from baige_ray.models.policy_loss import PolicyLossConfig
from baige_ray.rl.config import GRPOConfig
from baige_ray.rl.faults import RolloutFaultPlan
from baige_ray.rl.trainer import GRPOTrainer, RolloutOptions
from tests.hf_helpers import SEQ_LEN, build_tiny_hf
from tests.helpers import free_port

PROMPTS = ["def ", "class ", "import ", "return ", "if ", "for "]
CONFIG = GRPOConfig(num_iterations=3, prompts_per_iteration=2, group_size=4, max_new_tokens=16, learning_rate=1e-3,
                    updates_per_iteration=2, loss=PolicyLossConfig(kl_coef=0.05))


def vowels(prompt: str, completion: str) -> float:
    """Share of the completion's characters that are vowels: any exact, deterministic score will do."""
    return sum(c in "aeiou" for c in completion) / max(1, len(completion))


@pytest.fixture(scope="module")
def tiny(local_ray, tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-rl"))


def run(tiny, tmp_path, name: str, placement: str = "split", config: GRPOConfig = CONFIG, **faults):
    trainer = GRPOTrainer(HFModel(tiny.model_dir, seq_len=SEQ_LEN), prompts=PROMPTS, reward=vowels, config=config,
                          scaling=ScalingConfig(num_workers=2, placement_timeout_s=120),
                          run=RunConfig(name=name, storage_path=tmp_path, show_progress=False),
                          elastic=ElasticConfig(num_spares=0, min_workers=1),
                          rollout=RolloutOptions(num_replicas=1 if placement == "hybrid" else 2, port=free_port(),
                                                 device_share=0.75,
                                                 reference_device_share=0.25, placement=placement), **faults)
    return trainer.train()


def test_grpo_survives_a_trainer_and_a_rollout_replica_killed_and_matches_the_fault_free_run(tiny, tmp_path):
    clean = run(tiny, tmp_path, "rl-clean")
    assert [r.iteration for r in clean.iterations] == [0, 1, 2]
    assert all(len(r.rewards) == CONFIG.batch_size and math.isfinite(r.loss) for r in clean.iterations)
    assert all(r.refit_s > 0 for r in clean.iterations[:-1]) and clean.rollout_failures == []
    assert len(clean.training.metrics) == CONFIG.num_steps == 6

    replica_faults = RolloutFaultPlan().kill_replica(iteration=1)
    faulted = run(tiny, tmp_path, "rl-faulted", "colocated", faults=FaultPlan().crash(rank=1, step=3, at="backward"),
                  rollout_faults=replica_faults)
    assert clean.shared_devices == 0 and faulted.shared_devices == 2  # each worker beside a replica
    assert all(r.release_s > 0 for r in faulted.iterations) and all(r.release_s == 0 for r in clean.iterations)
    assert len(replica_faults.fired) == 1 and faulted.iterations[1].reissued > 0  # the kill landed mid-batch
    (recovery,) = faulted.training.recoveries
    assert recovery["lost_steps"] <= 1
    assert faulted.rewards == clean.rewards  # the same completions, sampled from the same weights
    # GRPO's loss is near zero whatever the weights (advantages average to zero): the weights tell the runs apart
    clean_weights, faulted_weights = (ray.get(r.training.final_state)["model"] for r in (clean, faulted))
    assert clean_weights.keys() == faulted_weights.keys()
    for name, tensor in clean_weights.items():
        # The sampler's log-probabilities set each update's ratio; a group re-issued elsewhere is decoded in
        # another batch, which changes their last bits (6.9e-6 at most measured on weights up to 0.09).
        torch.testing.assert_close(faulted_weights[name], tensor, rtol=1e-5, atol=2e-5, msg=name)


def test_one_step_off_policy_samples_beside_training_and_a_faulted_run_matches_the_fault_free_one(tiny, tmp_path):
    """`off_policy_lag=1`: iteration t + 1 is sampled while iteration t trains, from the weights t - 1 left.
    A trainer worker killed mid-step and a replica killed mid-batch change nothing: the same completions,
    the same weights."""
    config = GRPOConfig(num_iterations=3, prompts_per_iteration=2, group_size=4, max_new_tokens=16,
                        learning_rate=1e-3, off_policy_lag=1)
    clean = run(tiny, tmp_path, "rl-lag-clean", config=config)
    assert [r.iteration for r in clean.iterations] == [0, 1, 2] and clean.rollout_failures == []
    assert all(r.period_s > 0 for r in clean.iterations[1:]) and len(clean.training.metrics) == 3
    replica_faults = RolloutFaultPlan().kill_replica(iteration=2)
    faulted = run(tiny, tmp_path, "rl-lag-faulted", config=config, faults=FaultPlan().crash(rank=1, step=2),
                  rollout_faults=replica_faults)
    assert len(replica_faults.fired) == 1 and faulted.training.recoveries[0]["lost_steps"] <= 1
    assert faulted.rewards == clean.rewards
    clean_weights, faulted_weights = (ray.get(r.training.final_state)["model"] for r in (clean, faulted))
    for name, tensor in clean_weights.items():
        torch.testing.assert_close(faulted_weights[name], tensor, rtol=1e-5, atol=2e-5, msg=name)


def test_hybrid_rollouts_on_the_training_ranks_survive_a_worker_killed_and_match_the_fault_free_run(tiny, tmp_path):
    """Placement "hybrid": each worker samples its groups from its own weights as a step begins. A worker
    killed between two decode steps of its rollout changes nothing: the step is redone from memory and
    samples again what it sampled."""
    config = GRPOConfig(num_iterations=3, prompts_per_iteration=2, group_size=4, max_new_tokens=16,
                        learning_rate=1e-3)
    clean = run(tiny, tmp_path, "rl-hybrid-clean", "hybrid", config=config)
    assert [r.iteration for r in clean.iterations] == [0, 1, 2]
    assert all(len(r.rewards) == config.batch_size and r.rollout_s > 0 and r.refit_s == 0 for r in clean.iterations)
    assert all(r.period_s > 0 for r in clean.iterations[1:])
    faulted = run(tiny, tmp_path, "rl-hybrid-faulted", "hybrid", config=config,
                  faults=FaultPlan().crash(rank=1, step=1, at="sampling"))
    (recovery,) = faulted.training.recoveries
    assert recovery["lost_steps"] <= 1
    assert faulted.rewards == clean.rewards
    clean_weights, faulted_weights = (ray.get(r.training.final_state)["model"] for r in (clean, faulted))
    for name, tensor in clean_weights.items():
        torch.testing.assert_close(faulted_weights[name], tensor, rtol=1e-5, atol=2e-5, msg=name)


def test_a_refit_reads_the_jobs_state_where_it_lies_and_a_served_directory_keeps_the_callers_config(tiny):
    """Two faults a 494M-parameter refit found: the serving registry copied every state (two copies of a
    2 GB policy filled the object store), and serve() of a directory published the directory's own config,
    so the first refit with the caller's config rebuilt the model instead of copying into it."""
    from baige_ray.parallel.packed_tensors import pack_tensors
    from baige_ray.serving.app import _resolve_source
    from baige_ray.serving.registry import ServingRegistry

    model = HFModel(tiny.model_dir, seq_len=SEQ_LEN)
    assert _resolve_source(str(tiny.model_dir), model)[2] == model
    registry = ray.remote(ServingRegistry).options(num_cpus=0).remote()
    state = ray.put(pack_tensors({"w": torch.ones(3)}))
    ray.get(registry.publish_weights.remote(1, [state], model, False))
    assert ray.get(registry.weights.remote())[3][0] == state  # served from where the job keeps it
    ray.get(registry.publish_weights.remote(2, [state], model))
    assert ray.get(registry.weights.remote())[3][0] != state  # a copy of its own, by default
    ray.kill(registry)



def test_a_training_bound_split_run_moves_a_replicas_device_to_the_job(tiny, tmp_path):
    """Split placement sized from the measured phases (RolloutOptions.sizing): two replicas sampling two
    tokens while one worker trains the 32 sequences one at a time are held up by training, so the
    policy gives a replica's device to the job (Serve drains the replica first, then the job grows onto
    its device); every iteration runs, at the split the records name."""
    from baige_ray.rl.split_sizing import SplitSizing

    config = GRPOConfig(num_iterations=5, prompts_per_iteration=2, group_size=16, max_new_tokens=2,
                        micro_batch_size=1, learning_rate=1e-3)
    trainer = GRPOTrainer(HFModel(tiny.model_dir, seq_len=SEQ_LEN), prompts=PROMPTS, reward=vowels, config=config,
                          scaling=ScalingConfig(num_workers=1, placement_timeout_s=120),
                          run=RunConfig(name="rl-sized", storage_path=tmp_path, show_progress=False),
                          elastic=ElasticConfig(num_spares=0, min_workers=1, max_workers=2),
                          rollout=RolloutOptions(num_replicas=2, port=free_port(),
                                                 sizing=SplitSizing(pool_devices=3, min_gain=0.05, move_cost_s=0.0)))
    result = trainer.train()
    first = result.moves[0]
    assert (first.replicas, first.workers) == ((2, 1), (1, 2)) and first.seconds > 0
    splits = [(r.replicas, r.workers) for r in result.iterations]
    assert splits[:first.after_iteration + 2] == [(2, 1)] * (first.after_iteration + 1) + [(1, 2)]
    assert all(len(r.rewards) == config.batch_size and math.isfinite(r.loss) for r in result.iterations)
    assert len(result.training.metrics) == config.num_steps and result.rollout_failures == []
