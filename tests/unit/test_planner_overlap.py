"""Exposed data-parallel traffic (planner/overlap.py) against hand-computed cases.

One stage of L = 4 layers, a data-parallel group of 4 on a link of 1 GB/s without latency, so a
reduce-scatter or all-gather of M bytes takes 3/4 M ns and an all-reduce 3/2 M ns."""

import numpy as np
import pytest

from baige_ray.planner.cost import CostConstants, StageTimes
from baige_ray.planner.links import GroupLink
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.overlap import data_parallel_cost, hide

MODEL = ModelSpec(name="toy", num_layers=4, hidden=1000, ffn_hidden=4000, num_heads=10, seq_len=100,
                  vocab_size=2000, global_batch=8, dtype_bytes=2, learned_positions=False)
LINK = GroupLink(tier=2, bandwidth=1e9, latency=0.0)
LAYER_BYTES = 2 * MODEL.dense_layer_params  # 24 MB: 12 h^2 parameters in 16 bit
OUTSIDE_BYTES = 2 * (MODEL.embedding_params + MODEL.output_params)
STAGE_BYTES = 4 * LAYER_BYTES + OUTSIDE_BYTES


def _cost(zero: int, forward: float, backward: float, micro_batches: int = 1, overlap: float = 1.0,
          bucket: float = 25 * 2**20, overlapped=(0, 3), tp: int = 1, measured=None, link=LINK,
          measured_steps=None):  # (0, 3): DeepSpeed's default
    times = StageTimes(forward=np.array([[forward]]), backward=np.array([[backward]]), tp=np.zeros((1, 1)),
                       ep=np.zeros((1, 1)), pp=np.zeros((1, 1)))
    constants = CostConstants(overlap=overlap, ddp_bucket_bytes=bucket, overlapped_zero_stages=overlapped)
    dense = tp * np.array([MODEL.num_layers * MODEL.dense_layer_params + MODEL.embedding_params + MODEL.output_params])
    cost = data_parallel_cost(MODEL, times, constants, stage_layers=np.array([4]), stage_dense=dense,
                              stage_expert=np.zeros(1), tp=tp, dp=4, link=link, ep=[1], zero=[zero],
                              num_micro_batches=[micro_batches], measured_sharding=measured,
                              measured_zero_steps=measured_steps)
    return float(cost.total[0]), float(cost.exposed[0])


def gather_s(size: float) -> float:
    return 0.75 * size / 1e9


def test_hide_is_max_of_zero_and_the_difference_when_overlap_is_perfect_and_adds_all_of_it_when_none():
    assert hide(3.0, 2.0, 1.0) == 1.0 and hide(1.0, 2.0, 1.0) == 0.0
    assert hide(3.0, 2.0, 0.0) == 3.0 and hide(3.0, 2.0, 0.5) == 2.0


def test_ddp_all_reduce_hides_behind_the_last_backward_except_the_last_bucket():
    all_reduce = 1.5 * STAGE_BYTES / 1e9
    last_bucket = 1.5 * 25 * 2**20 / 1e9
    total, exposed = _cost(0, forward=1.0, backward=10.0)
    assert total == pytest.approx(all_reduce)
    assert exposed == pytest.approx(last_bucket)  # backward is longer: only the last bucket shows
    _, exposed = _cost(0, forward=0.01, backward=0.02)
    assert exposed == pytest.approx(all_reduce - 0.02)
    _, exposed = _cost(0, forward=0.01, backward=0.02, overlap=0.25)
    assert exposed == pytest.approx(all_reduce - 0.25 * 0.02)
    # Beside TP the engine all-reduces after backward: nothing hides it.
    total, exposed = _cost(0, forward=1.0, backward=10.0, tp=2)
    assert exposed == total == pytest.approx(all_reduce)


def test_a_dense_model_pays_no_latency_for_expert_collectives_it_never_issues():
    link = GroupLink(tier=2, bandwidth=1e9, latency=1e-3)
    total, exposed = _cost(0, forward=1.0, backward=10.0, tp=2, link=link)
    assert exposed == total == pytest.approx(2 * 3 * 1e-3 + 1.5 * STAGE_BYTES / 1e9)  # one ring: 2 (n - 1) hops


def test_zero1_hides_the_reduce_scatter_only_with_overlap_comm_never_the_gather_after_the_optimizer():
    half = gather_s(STAGE_BYTES)
    total, exposed = _cost(1, forward=1.0, backward=10.0, micro_batches=4)
    assert total == pytest.approx(2 * half) and exposed == pytest.approx(2 * half)  # DeepSpeed's default
    _, exposed = _cost(1, forward=1.0, backward=10.0, micro_batches=4, overlapped=(0, 1, 2, 3))
    assert exposed == pytest.approx(half)
    _, exposed = _cost(1, forward=0.01, backward=0.02, micro_batches=4, overlap=0.5, overlapped=(0, 1, 2, 3))
    assert exposed == pytest.approx(half - 0.5 * 0.02 + half)


def test_zero2_reduce_scatters_every_micro_batch():
    half = gather_s(STAGE_BYTES)
    total, exposed = _cost(2, forward=0.01, backward=0.02, micro_batches=4)
    assert total == pytest.approx(5 * half) and exposed == pytest.approx(5 * half)
    _, exposed = _cost(2, forward=0.01, backward=0.02, micro_batches=4, overlapped=(0, 1, 2, 3))
    assert exposed == pytest.approx(4 * (half - 0.02) + half)


def test_zero3_and_fsdp2_expose_the_first_gathers_the_outside_weights_and_the_last_reduce_scatter():
    ag, out = gather_s(LAYER_BYTES), gather_s(OUTSIDE_BYTES)
    total, exposed = _cost(3, forward=1.0, backward=2.0, micro_batches=2)  # compute hides every prefetch
    assert total == pytest.approx(2 * (2 * out + 4 * 3 * ag))
    assert exposed == pytest.approx(2 * ((out + ag) + (ag + ag + out)))
    forward, backward = 0.004, 0.008  # per layer 1 ms forward, 2 ms backward: less than a gather (18 ms)
    _, exposed = _cost(3, forward=forward, backward=backward, micro_batches=1)
    expected = (out + ag + 3 * (ag - forward / 4)) + (ag + ag + out + 3 * (2 * ag - backward / 4))
    assert exposed == pytest.approx(expected)


def test_zero3_takes_what_calibration_measured_sharding_adds_per_layer_in_place_of_the_layer_gathers():
    out = gather_s(OUTSIDE_BYTES)
    total, exposed = _cost(3, forward=1.0, backward=2.0, micro_batches=2, measured=[0.05])
    assert exposed == pytest.approx(2 * (2 * out + 4 * 0.05))  # 4 layers of 50 ms, twice, and the outside weights
    assert total == pytest.approx(_cost(3, forward=1.0, backward=2.0, micro_batches=2)[0])  # the traffic is the same


def test_zero1_and_zero2_take_what_calibration_measured_deepspeed_adds_per_layer_and_step():
    out = 2 * gather_s(OUTSIDE_BYTES)  # the outside weights' reduce-scatter and all-gather, priced from the link
    reduction = gather_s(STAGE_BYTES)  # DeepSpeed's default: ZeRO-2's reductions are not overlapped
    measured = {1: [0.03], 2: [0.04]}
    _, exposed = _cost(1, forward=1.0, backward=10.0, micro_batches=4, measured_steps=measured)
    assert exposed == pytest.approx(out + 4 * 0.03)  # ZeRO-1 reduces once, at the accumulation boundary
    total, exposed = _cost(2, forward=1.0, backward=10.0, micro_batches=4, measured_steps=measured)
    assert exposed == pytest.approx(out + 4 * 0.04 + 3 * reduction)  # the measured step holds one micro-batch's
    assert total == pytest.approx(_cost(2, forward=1.0, backward=10.0, micro_batches=4)[0])
    _, exposed = _cost(2, forward=1.0, backward=10.0, micro_batches=4, measured_steps={1: [0.03]})
    assert exposed == pytest.approx(5 * reduction)  # a stage not measured stays priced from the links


def test_no_data_parallelism_costs_nothing():
    times = StageTimes(forward=np.ones((1, 1)), backward=np.ones((1, 1)), tp=np.zeros((1, 1)), ep=np.zeros((1, 1)),
                       pp=np.zeros((1, 1)))
    for zero in range(4):
        cost = data_parallel_cost(MODEL, times, CostConstants(), stage_layers=np.array([4]),
                                  stage_dense=np.array([1e6]), stage_expert=np.zeros(1), tp=1, dp=1, link=LINK,
                                  ep=[1], zero=[zero], num_micro_batches=[2])
        assert cost.total[0] == 0.0 and cost.exposed[0] == 0.0
