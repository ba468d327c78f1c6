"""A mixture-of-experts GPT trains under expert-parallel layouts exactly as on one process.

One group of 4 worker actors runs each layout in turn (a new process-group generation each time);
every step's loss, load-balancing loss included, must match one process holding the whole model
and batch. Expert parallelism moves tokens with uneven all-to-alls and reduces expert gradients
over their own group, so only summation order differs from the reference.
"""

import dataclasses

import pytest

from baige_ray import RunConfig, TrainConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.jobs.fit import train_on_group
from baige_ray.models.gpt import GPTConfig
from baige_ray.models.moe import MoEConfig
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.state import merge_states

from ..helpers import at_full_speed, reference_losses, worker_group

MODEL = GPTConfig(seq_len=16, hidden=32, num_layers=2, num_heads=4,
                  moe=MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, aux_loss_coef=0.05,
                                overlap_shared_experts=True))
TRAIN = TrainConfig(num_steps=8, global_batch_size=8, micro_batch_size=2, warmup_steps=2, seed=3)
JOB = TrainJob(model=MODEL, train=TRAIN)
RUN = RunConfig(show_progress=False)
LAYOUTS = {
    "DP4 (experts replicated)": ParallelLayout(dp=4),
    "ZeRO-2 x4 (DeepSpeed, experts replicated)": ParallelLayout(dp=4, data_parallel="zero2"),
    "DP4xEP4": ParallelLayout(dp=4, ep=4),
    "FSDP2 x4 with EP2 (dense sharded, experts by index)": ParallelLayout(dp=4, ep=2, data_parallel="fsdp2"),
    "ZeRO-2 x4 with EP2 (DeepSpeed's expert groups)": ParallelLayout(dp=4, ep=2, data_parallel="zero2"),
    "DP2xEP2xTP2": ParallelLayout(dp=2, ep=2, tp=2),
    "PP2xDP2xEP2": ParallelLayout(pp=2, dp=2, ep=2),
}


@pytest.fixture(scope="module")
def reference():
    return reference_losses(JOB)


@pytest.fixture(scope="module")
def group(local_ray):
    yield from worker_group(4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layout_matches_one_process(group, reference, name):
    losses = [m.loss for m in train_on_group(group, JOB, at_full_speed(LAYOUTS[name]), RUN)]
    assert losses == pytest.approx(reference, rel=1e-4)


def test_pipelined_dispatch_chunks_match_one_process(group, reference):
    """Three token chunks per layer, one's all-to-alls in flight while another's experts compute."""
    chunked = dataclasses.replace(MODEL, moe=dataclasses.replace(MODEL.moe, dispatch_chunks=3))
    job = TrainJob(model=chunked, train=TRAIN)
    losses = [m.loss for m in train_on_group(group, job, at_full_speed(LAYOUTS["DP4xEP4"]), RUN)]
    assert losses == pytest.approx(reference, rel=1e-4)


def test_experts_reshard_in_memory_from_ep4_to_fsdp2_with_ep2(group, reference):
    half = TRAIN.num_steps // 2
    train_on_group(group, JOB, at_full_speed(LAYOUTS["DP4xEP4"]), RUN, end_step=half)
    state = merge_states(group.call("export_state"))
    assert state["model"]["blocks.1.mlp.experts.up"].shape == (4, 32, 128)  # canonical: every expert, by index
    assert state["optimizer"]["blocks.1.mlp.experts.up"]["exp_avg"].shape == (4, 32, 128)
    resumed = train_on_group(group, JOB, at_full_speed(LAYOUTS["FSDP2 x4 with EP2 (dense sharded, experts by index)"]),
                             RUN, start_step=half, initial_state=state)
    assert [m.loss for m in resumed] == pytest.approx(reference[half:], rel=1e-4)


def test_deepspeed_expert_state_leaves_zero1_with_ep4_and_resumes_in_zero2_with_ep2(group, reference):
    """Experts sharded by DeepSpeed's expert groups export whole (weights and Adam moments gathered over
    EP) and are cut again for another EP degree."""
    half = TRAIN.num_steps // 2
    train_on_group(group, JOB, at_full_speed(ParallelLayout(dp=4, ep=4, data_parallel="zero1")), RUN, end_step=half)
    state = merge_states(group.call("export_state"))
    assert state["optimizer"]["blocks.0.mlp.experts.down"]["exp_avg_sq"].shape == (4, 128, 32)
    resumed = train_on_group(group, JOB, at_full_speed(LAYOUTS["ZeRO-2 x4 with EP2 (DeepSpeed's expert groups)"]),
                             RUN, start_step=half, initial_state=state)
    assert [m.loss for m in resumed] == pytest.approx(reference[half:], rel=1e-4)


def test_a_pipeline_over_dense_and_moe_layers_splits_them_by_cost_and_matches_one_process(group):
    model = GPTConfig(seq_len=16, hidden=32, num_layers=4, num_heads=4,
                      moe=MoEConfig(num_experts=4, top_k=4, expert_ffn_hidden=256, num_dense_layers=2))
    job = TrainJob(model=model, train=TrainConfig(num_steps=6, global_batch_size=8, micro_batch_size=2, seed=3))
    layout = ParallelLayout(pp=2, dp=2, ep=2)
    assert job.plugin.layers_per_stage(layout) == (3, 1)  # one MoE layer costs more than two dense ones
    losses = [m.loss for m in train_on_group(group, job, at_full_speed(layout), RUN)]
    assert losses == pytest.approx(reference_losses(job), rel=1e-4)
