"""Every parallel layout on the simulated 2x4 cluster computes the single-process mathematics.

One group of 8 worker actors serves every layout: each layout is a new process-group
generation in the same processes, which is also how elastic re-planning reuses workers.
"""

import pytest

from baige_ray import GPTConfig, RunConfig, TrainConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.jobs.fit import train_on_group
from baige_ray.models.corpus import CorpusConfig
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.state import merge_states

from ..helpers import at_full_speed, reference_losses, worker_group

JOB = TrainJob(
    model=GPTConfig(seq_len=32, num_layers=4, num_heads=4, hidden=64),
    train=TrainConfig(num_steps=8, global_batch_size=16, warmup_steps=3, seed=11),
    data=CorpusConfig(max_bytes=1 << 20),
)
RUN = RunConfig(show_progress=False)
LAYOUTS = {
    "DP8": ParallelLayout(dp=8),
    "DP4xTP2": ParallelLayout(dp=4, tp=2),
    "DP2xPP2xTP2": ParallelLayout(dp=2, pp=2, tp=2),
    "ZeRO-3 DP8 (DeepSpeed)": ParallelLayout(dp=8, data_parallel="zero3"),
    "FSDP2 DP8": ParallelLayout(dp=8, data_parallel="fsdp2"),
}


@pytest.fixture(scope="module")
def group(sim_cluster):
    yield from worker_group(8)


@pytest.fixture(scope="module")
def reference():
    return reference_losses(JOB)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process_step_by_step(group, reference, name):
    losses = [m.loss for m in train_on_group(group, JOB, at_full_speed(LAYOUTS[name]), RUN)]
    assert losses == pytest.approx(reference, rel=1e-3)


@pytest.mark.parametrize(
    ("source", "target"), [("DP8", "DP2xPP2xTP2"), ("DP2xPP2xTP2", "ZeRO-3 DP8 (DeepSpeed)")]
)
def test_state_moves_between_layouts_without_changing_training(group, reference, source, target):
    half = JOB.train.num_steps // 2
    train_on_group(group, JOB, at_full_speed(LAYOUTS[source]), RUN, end_step=half)
    state = merge_states(group.call("export_state"))
    resumed = train_on_group(group, JOB, at_full_speed(LAYOUTS[target]), RUN, start_step=half, initial_state=state)
    assert [m.step for m in resumed] == list(range(half, JOB.train.num_steps))
    assert [m.loss for m in resumed] == pytest.approx(reference[half:], rel=1e-5)
