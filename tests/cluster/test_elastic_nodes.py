"""Losing and regaining a whole node: the planner re-lays the job out onto the survivors and grows it back
when the node returns; a node that held a whole pipeline stage is restored from a replica on another node.

On the simulated 4x2 cluster a node holds 2 fake GPUs. Every layout computes the step one process would,
so the runs agree with fault-free ones. (A fixed layout's shrink and growth on a node loss are checked with
a Hugging Face model in test_elastic_nodes_hf.py.)
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest

from baige_ray.api.configs import TrainConfig
from baige_ray.api.elastic import ElasticConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.gpt import GPTConfig
from baige_ray.topology.simulated import SimulatedCluster
from tests.helpers import devices_held, reference_losses


def wait_for(job, predicate, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = job.status()
        if predicate(status):
            return status
        assert time.monotonic() < deadline, f"timed out waiting for {what}; status: {status['state']} step {status['step']}"
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def no_leftover_actors(sim_cluster_4x2):
    yield
    from tests.helpers import kill_runs_named

    kill_runs_named("elastic-")


def cpu_speed_descriptor():
    """sim-4x2 with chips described at what they really compute here (CPU), so the planner's costs are true."""
    descriptor = SimulatedCluster.active().descriptor
    node_type = descriptor.node_types["sim-a100-node"]
    chip = dataclasses.replace(node_type.chip, peak_tflops=0.02)
    return dataclasses.replace(descriptor, node_types={"sim-a100-node": dataclasses.replace(node_type, chip=chip)})


def gpt_run(name: str, tmp_path, *, num_steps: int, num_layers: int, global_batch_size: int,
            micro_batch_size: int, elastic: ElasticConfig, num_workers: int = 8, **launch_args):
    """A small GPT on `num_workers` devices (all 8 by default) at a constant learning rate, so a run stopped
    after k steps and a k-step run do the same arithmetic."""
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.jobs.launch import launch

    return launch(
        GPTConfig(seq_len=32, hidden=64, num_layers=num_layers),
        train=constant_rate_train(num_steps, global_batch_size, micro_batch_size),
        scaling=ScalingConfig(num_workers=num_workers, placement_timeout_s=240),  # slow actor starts on a busy box
        run=RunConfig(name=name, storage_path=tmp_path, show_progress=False),
        elastic=elastic, **launch_args,
    )


def constant_rate_train(num_steps: int, global_batch_size: int, micro_batch_size: int) -> TrainConfig:
    return TrainConfig(num_steps=num_steps, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                       warmup_steps=0, learning_rate=3e-3, min_learning_rate=3e-3)


PLANNED_GPT = GPTConfig(seq_len=32, hidden=64, num_layers=2)


def planned_gpt_train(num_steps: int) -> TrainConfig:
    return constant_rate_train(num_steps, global_batch_size=24, micro_batch_size=1)


def planned_gpt_run(name: str, tmp_path, num_steps: int):
    """The planner lays this one out as DP3xTP2 on the 6 devices of nodes 0, 2 and 3 (node 1 held)."""
    return gpt_run(name, tmp_path, num_steps=num_steps, num_layers=2, global_batch_size=24, micro_batch_size=1,
                   num_workers=6,
                   # Node loss and return are what this job is for: a worker started on the returning node once
                   # missed the 2 s heartbeat window while the 2 cores ran 8 workers, and the job re-planned
                   # onto 6 again (correctly, but not the run this test describes). Freezes: test_elastic_cluster.
                   elastic=ElasticConfig(num_spares=0, min_workers=2, max_workers=6, grow_check_interval_s=0.5,
                                         heartbeat_timeout_s=6.0),
                   layout="auto", cluster=cpu_speed_descriptor())


def planners_pick_on(nodes: list[int]) -> str:
    """The layout the planner picks for PLANNED_GPT on the devices of `nodes` of the CPU-speed sim-4x2."""
    from baige_ray.elastic.planning import only_devices
    from baige_ray.runtime.auto_plan import layout_from_plan, plan_job
    from baige_ray.topology.graph import ResourceGraph

    graph = ResourceGraph.from_descriptor(cpu_speed_descriptor())
    left = np.array([d for d in range(graph.num_devices) if d // 2 in nodes])  # two devices a node
    job = TrainJob(model=PLANNED_GPT, train=constant_rate_train(1, 24, 1))
    return layout_from_plan(plan_job(job, only_devices(graph, left))).describe()


def test_the_planner_re_lays_out_the_job_after_a_node_loss_and_when_it_returns(sim_cluster_4x2, tmp_path):
    """Node 1 is held as another job would hold it, so the job fills the cluster with 6 workers: on the loss
    of a node it re-plans onto the 4 devices left, and when the node returns, onto 6 again."""
    cluster = SimulatedCluster.active()
    on_six, on_four = planners_pick_on([0, 2, 3]), planners_pick_on([0, 2])
    assert on_six.startswith("DP3xTP2 ") and on_four != on_six, "the planner's choices on CPU-speed chips"
    with devices_held(cluster, [1]):
        job = planned_gpt_run("elastic-planned", tmp_path, num_steps=1000)
        first = wait_for(job, lambda s: s["step"] >= 3, 180, "step 3")
        assert first["layout"] == on_six
        node_type = next(iter(cluster.descriptor.node_types))
        cluster.remove_node(3)
        shrunk = wait_for(job, lambda s: s["num_workers"] == 4 and s["state"] == "running", 60, "the re-plan onto 4")
        assert shrunk["layout"] == on_four, "the planner's choice for the 4 devices left"
        cluster.add_node(node_type, 3)
        regrown = wait_for(job, lambda s: s["num_workers"] == 6, 120, "the growth back to 6")
        assert regrown["layout"] == on_six
        wait_for(job, lambda s: s["step"] >= regrown["step"] + 2, 60, "steps after the growth")
        job.stop()
        result = job.wait()

    num_steps = len(result.metrics)
    assert [m.step for m in result.metrics] == list(range(num_steps))
    assert result.recoveries[0]["lost_steps"] <= 1
    plans = [e["reason"].split()[1] for e in result_events(tmp_path, "elastic-planned")
             if e["reason"].startswith("planner: ")]
    assert plans == [on_six.split()[0], on_four.split()[0], on_six.split()[0]], plans
    # One process with the whole model and batch: far cheaper than a second 8-worker run of every step.
    reference = reference_losses(TrainJob(model=PLANNED_GPT, train=planned_gpt_train(num_steps)))
    # The two layouts sum gradients in different orders, and Adam carries the rounding forward: over
    # ~70 steps it grew to 1.5e-3 (20 steps of two layouts stay within 1e-3, test_layouts_cluster.py).
    # A wrong data position or lost optimizer state is a jump of several percent at the re-plan.
    np.testing.assert_allclose([m.loss for m in result.metrics], reference, rtol=5e-3)


def result_events(tmp_path, run_name: str) -> list[dict]:
    path = next(tmp_path.rglob(f"{run_name}/events.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


PIPELINED_GPT = GPTConfig(seq_len=32, hidden=64, num_layers=4)


def pipelined_gpt_run(name: str, tmp_path, num_steps: int):
    """PP2 x TP2 on two nodes of the 4x2 cluster: each stage's two ranks on one node, so no live peer
    elsewhere holds it."""
    from baige_ray.parallel.layout import ParallelLayout

    return gpt_run(name, tmp_path, num_steps=num_steps, num_layers=4, global_batch_size=8, micro_batch_size=2,
                   elastic=ElasticConfig(num_spares=0, min_workers=4, max_workers=4), num_workers=4,
                   layout=ParallelLayout(pp=2, tp=2, num_microbatches=4))


def test_a_lost_node_holding_a_whole_pipeline_stage_is_restored_from_a_replica_on_another_node(
        sim_cluster_4x2, tmp_path):
    """Nodes 0 and 1 are held as another job would hold them: the job runs on nodes 2 and 3, one stage each,
    and after node 2 is lost it waits for capacity (2 devices cannot hold PP2 x TP2)."""
    cluster = SimulatedCluster.active()
    with devices_held(cluster, [0, 1]):
        job = pipelined_gpt_run("elastic-replica", tmp_path, num_steps=1000)
        wait_for(job, lambda s: s["step"] >= 5, 180, "step 5")
        node_type = next(iter(cluster.descriptor.node_types))
        cluster.remove_node(2)
        wait_for(job, lambda s: s["state"] == "recovering", 30, "the recovery")
        cluster.add_node(node_type, 2)
        resumed = wait_for(job, lambda s: s["state"] == "running" and s["recoveries"], 180, "the resumed run")
        wait_for(job, lambda s: s["step"] >= resumed["step"] + 2, 60, "steps after the recovery")
        job.stop()
        result = job.wait()

    num_steps = len(result.metrics)
    assert [m.step for m in result.metrics] == list(range(num_steps))
    restored = [e for e in result_events(tmp_path, "elastic-replica") if e["reason"].startswith("restored the replica")]
    assert restored, "the lost stage came from the replica, not from a checkpoint or from step 0"
    print(f"pipeline node loss: {result.recoveries[0]}; {restored[0]['reason']}")
    # A replica trails by at most one copy, which the controller waits for when copying is slower than a
    # step (replicas.replica_floor): the failed step, the one before and the one being copied (2 if it landed).
    assert result.recoveries[0]["lost_steps"] <= 3, (result.recoveries[0], restored)
    # One process with the whole model and batch, not a second run of the job. PP2 x TP2 sums in another
    # order; restoring a stage from a replica steps behind without redoing those steps is a jump of
    # several percent at the recovery.
    reference = reference_losses(TrainJob(model=PIPELINED_GPT, train=constant_rate_train(num_steps, 8, 2)))
    np.testing.assert_allclose([m.loss for m in result.metrics], reference, rtol=2e-3)
