"""An explicit layout whose memory does not fit the live cluster is refused before any worker actor starts.

The simulated 2x4 cluster's chips hold 80 GB; the descriptor handed to `fit` / `launch` here is the same
cluster with 0.5 GB chips, so a GPT of 50M parameters (0.8 GB of fp32 weights, gradients and Adam)
does not fit a device. Nothing is built or trained: each refusal comes in about a second.
"""

from __future__ import annotations

import dataclasses

import pytest
import ray

import baige_ray.jobs.fit as fit_module
from baige_ray import GPTConfig, RunConfig, ScalingConfig, TrainConfig, fit, launch
from baige_ray.api.errors import InfeasiblePlanError
from baige_ray.elastic.workers import NAMESPACE
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.corpus import CorpusConfig
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.planner.memory import logit_bytes
from baige_ray.runtime.memory_check import check_layout_memory
from baige_ray.topology.descriptor import load_descriptor

from ..conftest import SIM_2X4

MODEL = GPTConfig(seq_len=64, num_layers=4, num_heads=8, hidden=1024)
CORPUS = CorpusConfig(max_bytes=1 << 20)
TRAIN = TrainConfig(num_steps=1, global_batch_size=8)
REFUSAL = ("DP2 (ddp) of gpt needs 0.89 GB per device (weights+grads+Adam 0.82, activations 0.077); "
           "sim-a100 has 0.45 GB usable (90% of 0.5 GB)")


def small_chips(chip_gb: float):
    descriptor = load_descriptor(SIM_2X4)
    node_types = {name: dataclasses.replace(node, chip=dataclasses.replace(node.chip, memory_gb=chip_gb))
                  for name, node in descriptor.node_types.items()}
    return dataclasses.replace(descriptor, node_types=node_types)


def small_hosts(host_gb: float):
    descriptor = load_descriptor(SIM_2X4)
    node_types = {name: dataclasses.replace(node, memory_gb=host_gb) for name, node in descriptor.node_types.items()}
    return dataclasses.replace(descriptor, node_types=node_types)


@pytest.fixture
def simulated(sim_cluster):
    if not sim_cluster.simulated:
        pytest.skip("the small-chip descriptor only describes the simulated cluster")
    return sim_cluster


def run_actor_names(run_name: str) -> list[str]:
    return [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == NAMESPACE and f":{run_name}" in entry["name"]]


def test_fit_refuses_a_layout_whose_devices_are_too_small_before_any_worker_starts(simulated, tmp_path,
                                                                                    monkeypatch):
    groups = []
    monkeypatch.setattr(fit_module, "WorkerGroup", lambda *args, **kwargs: groups.append(args))
    run = RunConfig(name="too-big", storage_path=tmp_path, show_progress=False)
    with pytest.raises(InfeasiblePlanError) as refused:
        fit(MODEL, train=TRAIN, scaling=ScalingConfig(num_workers=2), run=run, data=CORPUS,
            layout=ParallelLayout(dp=2), cluster=small_chips(0.5))
    assert str(refused.value) == REFUSAL
    assert refused.value.budget == "device memory" and refused.value.needed_gb > refused.value.available_gb
    assert groups == []  # no worker group, so no WorkerActor, was ever asked for


def test_launch_refuses_it_too_and_leaves_no_controller_or_worker(simulated, tmp_path):
    run = RunConfig(name="too-big-elastic", storage_path=tmp_path, show_progress=False)
    with pytest.raises(InfeasiblePlanError, match="DP2 \\(ddp\\) of gpt needs 0.89 GB per device"):
        launch(MODEL, train=TRAIN, scaling=ScalingConfig(num_workers=2), run=run, data=CORPUS,
               layout=ParallelLayout(dp=2), cluster=small_chips(0.5))
    assert run_actor_names(run.name) == []


def test_launch_refuses_a_layout_whose_snapshots_overflow_host_memory_before_any_worker_starts(simulated, tmp_path):
    """The chips hold the model, but a host of 4 GB (1.8 usable beside Ray's own processes) cannot hold two
    workers' two snapshots each."""
    run = RunConfig(name="too-big-host", storage_path=tmp_path, show_progress=False)
    with pytest.raises(InfeasiblePlanError) as refused:
        launch(MODEL, train=TRAIN, scaling=ScalingConfig(num_workers=2), run=run, data=CORPUS,
               layout=ParallelLayout(dp=2), cluster=small_hosts(4.0))
    assert str(refused.value).startswith("DP2 (ddp) of gpt needs ")
    assert "GB of host memory on node 0" in str(refused.value) and "snapshots " in str(refused.value)
    assert "the node has 1.8 GB usable (95% of 4.0 GB" in str(refused.value)
    assert refused.value.budget == "host memory of node 0"
    assert refused.value.needed_gb > refused.value.available_gb == pytest.approx(1.8)
    assert run_actor_names(run.name) == []


def test_the_live_graph_prices_a_fitting_layout_and_its_snapshots(simulated):
    from baige_ray.api.elastic import ElasticConfig

    job = TrainJob(model=MODEL, train=TRAIN, data=CORPUS)
    layout = ParallelLayout(dp=2, pp=2, num_microbatches=2)
    plain = check_layout_memory(job, ScalingConfig(num_workers=4), layout)
    assert plain.node_ids == (0,) and plain.host_bytes == (0.0,)  # accelerators: nothing in host memory
    elastic = check_layout_memory(job, ScalingConfig(num_workers=4), layout, elastic=ElasticConfig(num_spares=1))
    # Both pipeline stages sit on node 0 alone: the spare (on node 1) and rank 0 each keep two whole replicas
    # beside every rank's two snapshots of its stage.
    model = 12 * job.plugin.model_spec(global_batch=8, dtype_bytes=4).num_params
    assert elastic.node_ids == (0, 1)
    assert elastic.host_bytes == pytest.approx((2 * 2 * model + 2 * model, 2 * model), rel=1e-4)


def test_bf16_mixed_precision_halves_the_layer_activations_and_keeps_the_fp32_states_and_logits(simulated):
    layout, scaling = ParallelLayout(dp=2), ScalingConfig(num_workers=2)
    fp32 = check_layout_memory(TrainJob(model=MODEL, train=TRAIN, data=CORPUS), scaling, layout)
    bf16 = dataclasses.replace(TRAIN, precision="bf16-mixed")
    mixed = check_layout_memory(TrainJob(model=MODEL, train=bf16, data=CORPUS), scaling, layout)
    assert mixed.state_bytes == fp32.state_bytes
    spec = TrainJob(model=MODEL, train=TRAIN, data=CORPUS).plugin.model_spec(global_batch=TRAIN.global_batch_size)
    logits = tuple(logit_bytes(spec, 1)[0] * TRAIN.global_batch_size / 2)  # fp32 for the loss either way
    assert mixed.activation_bytes == pytest.approx(tuple((a - l) / 2 + l for a, l in zip(fp32.activation_bytes, logits)))
