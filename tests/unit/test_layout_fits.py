"""An explicit layout priced before any actor starts: device memory per worker, host memory per node."""

import dataclasses

import pytest
import yaml

from baige_ray.api.configs import TrainConfig
from baige_ray.api.errors import InfeasiblePlanError
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.planner.fits import (
    DEEPSPEED_REDUCE_BUCKET,
    DEEPSPEED_SUB_GROUP,
    WORKER_PROCESS_BYTES,
    HostCopies,
    LayoutShape,
    check_fits,
    device_bytes,
    layout_shape,
    snapshot_bytes,
)
from baige_ray.planner.model_spec import load_model_spec
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.replicas import REPLICA_BUFFERS, SNAPSHOT_BUFFERS, host_copies
from baige_ray.topology.descriptor import descriptor_from_dict
from baige_ray.topology.graph import ResourceGraph

from ..conftest import REPO_ROOT, SIM_4X2

# Qwen2.5-0.5B at 16 bytes a parameter (fp32 weights, gradients, Adam): 7.9 GB of model states.
QWEN = dataclasses.replace(load_model_spec(REPO_ROOT / "examples" / "models" / "qwen2.5-0.5b.json", global_batch=8,
                                           seq_len=512), dtype_bytes=4)


def _ddp(dp: int, name: str = "") -> LayoutShape:
    return LayoutShape(name=name or f"DP{dp} (ddp)", dp=dp, micro_batch=1, num_micro_batches=8 // dp,
                       stage_layers=(QWEN.num_layers,), compute_dtype_bytes=4)


def _sim_4x2(*, chip_gb: float = 80.0, host_gb: float = 512.0, accelerator: str = "cuda") -> ResourceGraph:
    data = yaml.safe_load(SIM_4X2.read_text())
    node = data["node_types"]["sim-a100-node"]
    node["chip"]["memory_gb"], node["memory_gb"], node["accelerator"] = chip_gb, host_gb, accelerator
    return ResourceGraph.from_descriptor(descriptor_from_dict(data))


def test_a_layout_that_fits_returns_what_it_needs():
    fit = check_fits(QWEN, _sim_4x2(), _ddp(2))
    (states,), (activations,) = fit.state_bytes, fit.activation_bytes
    assert states == pytest.approx(16 * QWEN.num_params, rel=1e-3)
    assert 0 < activations < states and fit.device_bytes[0] < 0.9 * 80e9
    assert fit.node_ids == (0,) and fit.host_bytes == (0.0,)  # accelerators: nothing lives in host memory
    assert fit.host_capacity_bytes == pytest.approx((0.95 * 512e9 - 2e9,))  # what Ray lets it fill, less a reserve


def test_ddp_of_a_big_model_on_small_devices_is_refused_with_the_numbers():
    with pytest.raises(InfeasiblePlanError) as refused:
        check_fits(QWEN, _sim_4x2(chip_gb=6.7), _ddp(2))
    error = refused.value
    assert str(error) == ("DP2 (ddp) of qwen2.5-0.5b needs 10.1 GB per device (weights+grads+Adam 7.9, "
                          "activations 2.2); sim-a100 has 6.0 GB usable (90% of 6.7 GB)")
    assert error.budget == "device memory" and error.layout == "DP2 (ddp)"
    assert error.needed_gb == pytest.approx(10.1, abs=0.05) and error.available_gb == pytest.approx(6.03)


def test_sharding_the_states_makes_room_that_ddp_lacks():
    fsdp = dataclasses.replace(_ddp(4, "DP4 (fsdp2)"), zero_stage=3, experts_sharded=False)
    states, _ = device_bytes(QWEN, fsdp)
    assert states[0] < 0.5 * 16 * QWEN.num_params  # a quarter each, plus what ZeRO-3 gathers
    check_fits(QWEN, _sim_4x2(chip_gb=8), fsdp)
    with pytest.raises(InfeasiblePlanError):
        check_fits(QWEN, _sim_4x2(chip_gb=8), _ddp(4))


def test_cpu_workers_sharing_a_node_are_refused_on_its_host_memory():
    # Four CPU "devices" per node of 16 GB each fit one worker apiece, but the node has 32 GB for all of them
    # (28.4 usable: 95%, the share Ray's memory monitor allows, less 2 GB for Ray's own processes).
    descriptor = yaml.safe_load(SIM_4X2.read_text())
    descriptor["node_types"]["sim-a100-node"].update(num_devices=4, nics=[])
    descriptor["node_types"]["sim-a100-node"]["chip"]["memory_gb"] = 16
    descriptor["node_types"]["sim-a100-node"].update(accelerator="cpu", memory_gb=32)
    graph = ResourceGraph.from_descriptor(descriptor_from_dict(descriptor))
    fit = check_fits(QWEN, graph, _ddp(2))  # two workers: 21.4 of 28.4 GB
    assert fit.host_bytes[0] == pytest.approx(2 * (fit.device_bytes[0] + WORKER_PROCESS_BYTES))
    with pytest.raises(InfeasiblePlanError) as refused:
        check_fits(QWEN, graph, _ddp(4))
    error = refused.value
    assert error.budget == "host memory of node 0"
    assert str(error) == ("DP4 (ddp) of qwen2.5-0.5b needs 42.9 GB of host memory on node 0 (sim-a100-node, "
                          "4 workers: workers on cpu devices (process, model states, activations) 42.9); the node has "
                          "28.4 GB usable (95% of 32.0 GB, the share Ray lets it fill, less 2 GB for Ray's own "
                          "processes, the driver and the controller)")
    assert error.needed_gb == pytest.approx(4 * (fit.device_bytes[0] + WORKER_PROCESS_BYTES) / 1e9)  # DDP: replicas alike
    assert error.needed_gb > error.available_gb == pytest.approx(28.4)


def test_snapshot_copies_add_host_bytes_per_worker_on_its_node():
    graph, shape = _sim_4x2(), _ddp(4)
    snapshot = snapshot_bytes(QWEN, shape)[0]
    assert snapshot == pytest.approx(12 * QWEN.num_params, rel=1e-3)  # fp32 weights and Adam's two moments
    plain = check_fits(QWEN, graph, shape)
    elastic = check_fits(QWEN, graph, shape, copies=HostCopies(snapshot_copies=2))
    assert plain.host_bytes == (0.0, 0.0)
    assert elastic.node_ids == (0, 1) and elastic.host_bytes == pytest.approx((4 * snapshot, 4 * snapshot))
    with pytest.raises(InfeasiblePlanError, match=r"needs 23\.7 GB of host memory on node 0 .*snapshots 23\.7 "
                                                  r"\(2 per worker\)\); the node has 17\.0 GB usable"):
        check_fits(QWEN, _sim_4x2(host_gb=20), shape, copies=HostCopies(snapshot_copies=2))


def test_sharded_snapshots_take_a_dp_th_of_the_state_per_worker_and_their_slots_count():
    graph = _sim_4x2()
    fsdp = dataclasses.replace(_ddp(4), name="DP4 (fsdp2)", zero_stage=3)
    whole = snapshot_bytes(QWEN, _ddp(4))[0]
    assert snapshot_bytes(QWEN, fsdp)[0] == pytest.approx(whole / 4)
    one_slot = check_fits(QWEN, graph, fsdp, copies=HostCopies(snapshot_copies=1))
    assert one_slot.host_bytes == pytest.approx((2 * whole / 4, 2 * whole / 4))
    # A sharded stage spans every rank, so with two nodes it is exposed and replicas (whole) are kept.
    copies = host_copies([0, 0, 0, 0], ["0", "0", "1", "1"], num_spares=0, replicate=True, sharded=True,
                         snapshot_slots=1)
    assert copies.snapshot_copies == 1 and copies.replica_workers == (0, 2)
    fit = check_fits(QWEN, graph, fsdp, copies=copies)
    assert fit.host_bytes == pytest.approx((2 * whole / 4 + REPLICA_BUFFERS * whole,) * 2)


def test_replicas_count_on_the_workers_that_hold_them():
    graph, shape = _sim_4x2(), _ddp(2)
    copies = HostCopies(snapshot_copies=2, replica_workers=(2,), replica_copies=2, num_spares=1)
    fit = check_fits(QWEN, graph, shape, copies=copies)
    snapshot = snapshot_bytes(QWEN, shape)[0]
    assert fit.node_ids == (0, 1)  # the spare is the first device of node 1
    assert fit.host_bytes == pytest.approx((4 * snapshot, 2 * snapshot))
    with pytest.raises(ValueError, match="HostCopies.replica_workers"):
        check_fits(QWEN, graph, shape, copies=HostCopies(replica_workers=(3,), replica_copies=1))


def test_elastic_replicas_go_to_spares_first_only_where_a_stage_is_exposed():
    # PP2 over nodes 0 and 1: each stage on one node; a spare on node 2 and rank 0 on node 0 hold replicas.
    copies = host_copies([0, 0, 1, 1], ["0", "0", "1", "1", "2"], num_spares=1, replicate=True)
    assert copies == HostCopies(snapshot_copies=SNAPSHOT_BUFFERS, replica_workers=(4, 0),
                                replica_copies=REPLICA_BUFFERS, num_spares=1)
    spread = host_copies([0, 0, 0, 0], ["0", "0", "1", "1"], num_spares=0, replicate=True)
    assert spread.replica_workers == () and spread.replica_copies == 0 and spread.snapshot_copies == 2
    assert host_copies([0, 1], ["0", "0"], num_spares=0, replicate=False).replica_workers == ()


def test_layout_shape_follows_the_engines():
    train = TrainConfig(num_steps=1, global_batch_size=16)
    pipeline = layout_shape(ParallelLayout(dp=2, pp=2, num_microbatches=4, pipeline_schedule="interleaved-1f1b"),
                            train, (2, 2, 1, 1), compute_dtype_bytes=4)
    assert (pipeline.micro_batch, pipeline.num_micro_batches, pipeline.stage_layers) == (2, 4, (3, 3))
    assert pipeline.zero_stage == 0 and pipeline.name == "DP2xPP2 (ddp)"
    accumulated = layout_shape(ParallelLayout(dp=4, data_parallel="fsdp2"),
                               dataclasses.replace(train, micro_batch_size=2), (4,), compute_dtype_bytes=2)
    assert (accumulated.micro_batch, accumulated.num_micro_batches, accumulated.zero_stage) == (2, 2, 3)
    assert not accumulated.experts_sharded
    single = layout_shape(ParallelLayout(dp=1, data_parallel="zero2"), train, (4,), compute_dtype_bytes=4)
    assert (single.zero_stage, single.micro_batch) == (0, 16)  # nothing to shard over one replica
    uneven = layout_shape(ParallelLayout(dp=3, dp_microbatches=(6, 5, 5)), train, (4,), compute_dtype_bytes=4)
    assert uneven.micro_batch == 6


def test_layout_shape_fields_are_validated():
    with pytest.raises(ValueError, match=r"LayoutShape.stage_layers=\(4,\) is invalid: expected pp=2"):
        LayoutShape(name="x", pp=2, micro_batch=1, stage_layers=(4,))
    with pytest.raises(ValueError, match="LayoutShape.zero_stage=4 is invalid"):
        LayoutShape(name="x", zero_stage=4, micro_batch=1, stage_layers=(4,))
    with pytest.raises(ValueError, match="HostCopies.snapshot_copies=-1 is invalid"):
        HostCopies(snapshot_copies=-1)


def test_deepspeed_zero3_adds_its_bf16_partition_copy_gradient_bucket_and_fp32_gradient_copy():
    fsdp = dataclasses.replace(_ddp(2, "DP2 (fsdp2)"), zero_stage=3, compute_dtype_bytes=2)
    deepspeed = dataclasses.replace(fsdp, name="DP2 (zero3)", deepspeed=True)
    (fsdp_states, fsdp_activations), (ds_states, ds_activations) = device_bytes(QWEN, fsdp), device_bytes(QWEN, deepspeed)
    assert ds_activations == pytest.approx(fsdp_activations)
    bucket = 2 * min(DEEPSPEED_REDUCE_BUCKET, QWEN.num_params)
    fp32_gradients = 4 * min(DEEPSPEED_SUB_GROUP, QWEN.num_params / 2)
    assert ds_states - fsdp_states == pytest.approx(2 * QWEN.num_params / 2 + bucket + fp32_gradients)


def test_usable_host_memory_follows_rays_memory_threshold_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.8")
    assert check_fits(QWEN, _sim_4x2(), _ddp(2), options=PlanOptions()).host_capacity_bytes == (0.8 * 512e9 - 2e9,)
    with pytest.raises(ValueError, match="usable_host_memory_fraction"):
        PlanOptions(usable_host_memory_fraction=0.0)
    with pytest.raises(ValueError, match="host_memory_reserve_gb"):
        PlanOptions(host_memory_reserve_gb=-1.0)
    monkeypatch.setenv("RAY_memory_usage_threshold", "most")
    with pytest.raises(ValueError, match="RAY_memory_usage_threshold='most' is invalid"):
        PlanOptions()


def test_the_exact_gradient_sum_adds_its_held_micro_batch_gradients_and_int64_sum():
    """world_size_invariant holds each local micro-batch's fp32 gradient (4 here, not 1) and an int64 sum."""
    train = TrainConfig(num_steps=1, global_batch_size=8, micro_batch_size=1, world_size_invariant=True)
    shape = layout_shape(ParallelLayout(dp=2), train, (QWEN.num_layers,), compute_dtype_bytes=4)
    assert shape.extra_gradient_copies == 4 + 1
    (plain_states, activations), (exact_states, exact_activations) = device_bytes(QWEN, _ddp(2)), device_bytes(QWEN, shape)
    assert exact_activations == pytest.approx(activations)
    assert exact_states - plain_states == pytest.approx(5 * 4 * QWEN.num_params, rel=1e-3)
