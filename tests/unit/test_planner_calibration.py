"""Calibration (planner/calibration.py): fits, storage, fingerprints, and the planner pricing with it."""

import dataclasses

import numpy as np
import pytest

from baige_ray.planner.bruteforce import brute_force
from baige_ray.planner.calibration import (
    COLLECTIVES,
    Calibration,
    ChipCalibration,
    CollectiveSample,
    ComputeCurve,
    ShardingCost,
    collective_coefficients,
    fit_link,
    graph_fingerprint,
    shape_key,
    sharding_key,
)
from baige_ray.planner.links import probe_groups
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.plan import plan
from baige_ray.planner.search import Hardware, search
from baige_ray.topology.descriptor import load_descriptor
from baige_ray.topology.graph import LinkTier, ResourceGraph

from ..conftest import REPO_ROOT

MODEL = ModelSpec(name="small", num_layers=4, hidden=256, ffn_hidden=1024, num_heads=8, seq_len=128, vocab_size=256,
                  global_batch=16, dtype_bytes=4)


def _graph(name: str = "sim-2x4") -> ResourceGraph:
    return ResourceGraph.from_descriptor(load_descriptor(REPO_ROOT / "clusters" / f"{name}.yaml"))


def _samples(tier: int, latency: float, bandwidth: float) -> list[CollectiveSample]:
    samples = []
    for kind in COLLECTIVES:
        for n in (2, 4):
            for size in (65536, 1 << 20, 8 << 20):
                alpha, volume = collective_coefficients(kind, n if kind != "send_recv" else 2, size)
                samples.append(CollectiveSample(tier=tier, kind=kind, group_size=n if kind != "send_recv" else 2,
                                                size_bytes=size, seconds=alpha * latency + volume / bandwidth))
    return samples


def _calibration(rate: float = 2e10, overlap: float = 0.5) -> Calibration:
    chip = ChipCalibration(chip="sim-a100", peak_flops=312e12)
    for tp in (1, 2, 4):
        curve = ComputeCurve(tokens=(128, 2048), flops_per_s=(rate / 2, rate))
        chip.layer[shape_key(MODEL, tp)] = chip.head[shape_key(MODEL, tp)] = curve
        chip.sharding[sharding_key(MODEL, tp, 8 // tp)] = ShardingCost(tokens=(128, 2048), extra_s=(1e-3, 4e-3))
    for zero in (1, 2):  # DeepSpeed's ZeRO-1/2, which the engines run without TP
        chip.sharding[sharding_key(MODEL, 1, 8, zero)] = ShardingCost(tokens=(128, 2048), extra_s=(zero * 1e-3,) * 2)
    links = {tier: fit_link(_samples(tier, 50e-6 * (tier + 1), 2e9 / (tier + 1))) for tier in (0, 2, 3)}
    return Calibration(fingerprint=graph_fingerprint(_graph()), backend="gloo", chips={"sim-a100": chip},
                       links=links, overlap=overlap, optimizer_s_per_param=1e-8, step_overhead_s=0.002)


def test_link_fit_recovers_latency_and_bandwidth_of_every_collective():
    fit = fit_link(_samples(2, latency=40e-6, bandwidth=3e9))
    assert fit.latency_s == pytest.approx(40e-6, rel=1e-6) and fit.bandwidth == pytest.approx(3e9, rel=1e-6)
    assert fit.rms_rel_error < 1e-9 and set(fit.kinds) == set(COLLECTIVES)
    assert fit.kinds["all_to_all"].bandwidth == pytest.approx(3e9, rel=1e-6)


def test_compute_curve_interpolates_in_log_space_and_holds_its_ends():
    curve = ComputeCurve(tokens=(100, 10000), flops_per_s=(1e9, 1e11))
    assert curve.rate([1000])[0] == pytest.approx(1e10)
    assert curve.rate([10, 1e6]).tolist() == pytest.approx([1e9, 1e11])
    with pytest.raises(ValueError, match="ascend"):
        ComputeCurve(tokens=(10, 5), flops_per_s=(1.0, 1.0))


def test_past_its_largest_token_count_a_curve_grows_a_calls_time_by_its_last_seconds_per_token():
    def rate(tokens):  # a call costs 50 ms plus 0.1 ms per token, for one FLOP per token
        return tokens / (0.05 + 1e-4 * tokens)

    curve = ComputeCurve(tokens=(128, 256, 1024), flops_per_s=tuple(rate(n) for n in (128, 256, 1024)))
    assert curve.rate([2048, 8192]).tolist() == pytest.approx([rate(2048), rate(8192)])
    assert curve.rate([2048])[0] < 1e4  # never past the marginal rate: 1 / 0.1 ms
    # A last call no slower than the one before (noise) gives no slope to follow: the rate is held.
    noisy = ComputeCurve(tokens=(256, 1024), flops_per_s=(256 / 0.08, 1024 / 0.07))
    assert noisy.rate([4096])[0] == pytest.approx(1024 / 0.07)


def test_calibration_survives_json():
    calibration = _calibration()
    again = Calibration.from_json(calibration.to_json())
    assert again.to_json() == calibration.to_json()
    assert again.sharding_seconds(MODEL, 2, 4, [312e12], [128, 1088, 4096]).tolist() == pytest.approx([1e-3, 2.5e-3, 4e-3])
    assert again.sharding_seconds(MODEL, 2, 2, [312e12], [128]) is None  # not measured over 2
    assert again.sharding_seconds(MODEL, 1, 8, [312e12], [128], zero=2).tolist() == [2e-3]
    assert again.sharding_seconds(MODEL, 2, 4, [312e12], [128], zero=1) is None  # beside TP the engines run DDP
    assert "ZeRO-1/2 (DeepSpeed's cost per layer and step)" in again.measured_terms(MODEL, (1,), [312e12])
    with pytest.raises(ValueError, match="zero=0"):
        sharding_key(MODEL, 1, 8, 0)
    assert again.links[2].kinds["all_reduce"].latency_s == pytest.approx(calibration.links[2].kinds["all_reduce"].latency_s)
    with pytest.raises(ValueError, match="format"):
        Calibration.from_json('{"format": 0}')


def test_fingerprint_ignores_ray_node_names_but_not_the_hardware():
    graph = _graph()
    named = graph.with_node_names({int(n): f"ray-node-{n}" for n in graph.node_ids})
    assert graph_fingerprint(named) == graph_fingerprint(graph)
    assert graph_fingerprint(_graph("sim-4x2")) != graph_fingerprint(graph)
    assert graph_fingerprint(graph.without_nodes(graph.node_ids[1:])) != graph_fingerprint(graph)


def test_probe_groups_cover_every_tier_the_cluster_has():
    groups = probe_groups(_graph(), np.arange(8))
    assert set(groups) == {LinkTier.NVLINK, LinkTier.SAME_RAIL, LinkTier.CROSS_RAIL}
    assert groups[LinkTier.NVLINK] == [[0, 1], [0, 1, 2, 3]]
    assert groups[LinkTier.CROSS_RAIL][-1] == list(range(8))


def test_a_calibrated_plan_prices_compute_at_the_measured_rate_and_says_what_was_measured():
    calibration = _calibration(rate=2e10)
    chosen = plan(MODEL, _graph(), PlanOptions(calibration=calibration, recompute=("none",)))
    tokens = MODEL.global_batch * MODEL.seq_len
    flops = 3 * tokens * (MODEL.num_layers * MODEL.layer_flops_per_token + MODEL.logits_flops_per_token)
    per_device_rate = calibration.chips["sim-a100"].layer[shape_key(MODEL, chosen.tp)].rate(
        [chosen.micro_batch_size * MODEL.seq_len])[0]
    assert chosen.breakdown_s["compute"] == pytest.approx(flops / chosen.num_ranks / per_device_rate, rel=1e-9)
    assert chosen.breakdown_s["optimizer_and_framework"] > 0.002
    assert chosen.links["dp"].kinds  # measured per collective
    from baige_ray.planner.report import pricing_text

    assert "measured compute" in pricing_text(chosen) and "link NVLINK" in pricing_text(chosen)
    assert "nominal constants" in pricing_text(plan(MODEL, _graph()))


def test_calibrated_search_still_equals_brute_force():
    options = PlanOptions(calibration=_calibration(), recompute=("none", "full"), max_micro_batch=8)
    graph = _graph()
    exact = brute_force(MODEL, graph, options)
    pick = search(MODEL, options, Hardware(graph, options)).ranked[0]
    assert pick.step_s == pytest.approx(exact.step_s, rel=1e-9)
    assert pick.order_key[1:] == exact.order_key[1:]


def test_plan_options_refuse_what_is_not_a_calibration():
    with pytest.raises(ValueError, match="PlanOptions.calibration"):
        PlanOptions(calibration={"overlap": 0.5})
    assert dataclasses.replace(PlanOptions(), top_k=2).calibration is None


def test_a_kept_calibration_that_is_corrupt_or_of_another_format_is_ignored(tmp_path):
    from baige_ray.runtime.calibration_store import cache_path, load_calibration, save_calibration

    graph = _graph()
    assert load_calibration(graph, tmp_path) is None
    save_calibration(_calibration(), tmp_path)
    assert load_calibration(graph, tmp_path).overlap == 0.5
    cache_path(graph_fingerprint(graph), tmp_path).write_text("{not json")
    assert load_calibration(graph, tmp_path) is None


def test_a_bubble_lends_its_cores_to_busy_stages_where_devices_share_a_host():
    from baige_ray.planner.cost import pipeline_seconds

    stages = np.array([[1.0, 1.0, 1.0, 1.0]])  # 4 equal stages, 1 s per micro-batch each
    assert pipeline_seconds(stages, [2])[0] == pytest.approx(5.0)  # 1F1B: (m + p - 1) T
    # Two of four stages busy at once: each twice as fast with a sharing of 4 measured at a quarter busy
    assert pipeline_seconds(stages, [2], host_sharing=4.0, sharing_measured_at=0.25)[0] == pytest.approx(2.0)
    # A device alone gains only 2x: two busy already have all it can use, and the critical path bounds the step
    assert pipeline_seconds(stages, [2], host_sharing=2.0, sharing_measured_at=0.25)[0] == pytest.approx(5 / 2)
    # Cores shared out evenly: with 8 devices on one host measured 4.86x faster alone, 4 busy are 2x faster
    assert pipeline_seconds(np.ones((1, 8)), [4], host_sharing=4.86, sharing_measured_at=0.125)[0] == \
        pytest.approx(4 * 8 / (4 * 2))
    # One micro-batch: one stage at a time, with the cores of all four
    assert pipeline_seconds(stages, [1], host_sharing=6.4, sharing_measured_at=0.25)[0] == pytest.approx(4 / 6.4)
    assert pipeline_seconds(stages, [8], host_sharing=6.4, sharing_measured_at=0.25)[0] == pytest.approx(8.0)


def test_curves_measured_through_tensor_parallelism_hold_its_traffic_on_that_tier_only():
    calibration = _calibration()
    chip = calibration.chips["sim-a100"]
    chip.tp_tier[shape_key(MODEL, 2)] = int(LinkTier.NVLINK)
    graph = _graph()
    options = PlanOptions(calibration=calibration, recompute=("none",))
    from baige_ray.planner.evaluate import Layout
    from baige_ray.planner.plan import price_candidate
    from baige_ray.planner.search import Candidate

    def tp_seconds(mapping: str) -> float:
        candidate = Candidate(layout=Layout(tp=2, pp=1, dp=4, mapping=mapping), ep=1, zero=0, micro_batch=4,
                              recompute=0, step_s=0.0, memory_ratio=0.0)
        context, evaluation = price_candidate(MODEL, options, Hardware(graph, options), candidate)
        return context.links["tp"].tier, float(evaluation.times.tp.max())

    tier, seconds = tp_seconds("tp-dp-pp/node")
    assert tier == LinkTier.NVLINK and seconds == 0.0
    assert calibration.tensor_parallel_included(MODEL, 2, [312e12], LinkTier.NVLINK)
    assert not calibration.tensor_parallel_included(MODEL, 2, [312e12], LinkTier.CROSS_RAIL)
    assert not calibration.tensor_parallel_included(MODEL, 4, [312e12], LinkTier.NVLINK)


def test_a_calibration_request_measures_only_what_is_missing_within_the_probe_memory():
    from baige_ray.jobs.calibrate import CalibrationRequest, missing_compute, probe_bytes

    request = CalibrationRequest(models=(MODEL,))
    graph = _graph()
    assert [tp for _, tp in missing_compute(None, graph, request)] == [1, 2, 4]
    assert missing_compute(_calibration(), graph, request) == []
    older = _calibration()  # kept before ZeRO-1/2 were measured: TP 1 is measured again, the others kept
    del older.chips["sim-a100"].sharding[sharding_key(MODEL, 1, 8, 2)]
    assert [tp for _, tp in missing_compute(older, graph, request)] == [1]
    assert [tp for _, tp in missing_compute(_calibration(), graph, CalibrationRequest(models=(MODEL,), tps=(2,)))] == []
    twelve_heads = dataclasses.replace(MODEL, num_heads=12, hidden=384, ffn_hidden=1536, vocab_size=50304)
    assert request.tp_degrees(twelve_heads, devices_per_node=4, num_devices=8) == [1, 2, 4]  # not 3: 8 % 3
    wide = dataclasses.replace(MODEL, vocab_size=50304, seq_len=1024)
    cpu_limit = request.probe_memory_limit(accelerated=False, device_memory_gb=80.0)
    assert probe_bytes(wide, 1, 1) < cpu_limit < probe_bytes(wide, 1, 2)
    assert request.probe_memory_limit(accelerated=True, device_memory_gb=80.0) == 20e9  # a GPU holds far more


def test_the_planner_prices_only_what_was_measured_never_measured_links_beside_nominal_compute():
    from baige_ray.planner.report import pricing_text

    calibration = _calibration()
    del calibration.chips["sim-a100"].layer[shape_key(MODEL, 4)]  # TP 4 not measured
    options = PlanOptions(calibration=calibration, recompute=("none",))
    hardware = Hardware(_graph(), options)
    from baige_ray.planner.search import tensor_degrees

    assert tensor_degrees(MODEL, hardware) == [1, 2]
    assert plan(MODEL, _graph(), options).tp in (1, 2)
    other = dataclasses.replace(MODEL, name="other", hidden=512, ffn_hidden=2048)  # no curves at all
    chosen = plan(other, _graph(), options)
    assert chosen.options.calibration is None and "no compute figures of other's shapes" in pricing_text(chosen)
    assert chosen.step_time_s == pytest.approx(plan(other, _graph(), PlanOptions(recompute=("none",))).step_time_s)
