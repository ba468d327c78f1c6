"""bench planner's pure parts: rank correlation, accuracy summary, and the layouts it runs."""

import pytest

from baige_ray.bench.planner import accuracy, runnable_configs, spearman
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.topology.descriptor import load_descriptor
from baige_ray.topology.graph import ResourceGraph

from ..conftest import SIM_2X4


def test_spearman_is_one_for_the_same_order_minus_one_for_the_reverse_and_handles_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)


def test_accuracy_takes_absolute_errors_and_the_worst_models_correlation():
    rows = [{"model": "a", "predicted_s": p, "measured_s": m, "rel_error": p / m - 1}
            for p, m in ((1.0, 1.1), (2.0, 1.8), (3.0, 3.0))]
    rows += [{"model": "b", "predicted_s": p, "measured_s": m, "rel_error": p / m - 1} for p, m in ((1.0, 2.0), (2.0, 1.0))]
    result = accuracy(rows)
    assert result["max_rel_error"] == pytest.approx(1.0) and result["spearman"] == pytest.approx(-1.0)
    assert result["spearman_by_model"]["a"] == pytest.approx(1.0)


def test_every_layout_the_engines_run_on_8_devices_once_with_its_engine():
    spec = ModelSpec(name="gpt", num_layers=4, hidden=256, ffn_hidden=1024, num_heads=8, seq_len=128, vocab_size=256,
                     global_batch=16, dtype_bytes=4)
    configs = runnable_configs(spec, ResourceGraph.from_descriptor(load_descriptor(SIM_2X4)), None)
    layouts = {c["layout"] for c in configs}
    assert len(layouts) == len(configs) == 13
    assert {"tp=1 pp=1 dp=8 zero1", "tp=1 pp=1 dp=8 zero3", "tp=2 pp=1 dp=4 fsdp2", "tp=4 pp=2 dp=1 ddp"} <= layouts
    assert all(c["predicted_s"] > 0 and (16 // c["dp"]) % c["micro_batch"] == 0 for c in configs)
    assert not any(c["engine"].startswith("zero") and (c["tp"] > 1 or c["pp"] > 1) for c in configs)


def test_one_device_predictions_follow_a_measured_launch_bound_curve_and_pick_the_fastest_measured():
    """bench planner-host: compute that runs 8x faster at 8x the tokens (a GPU paying for kernel launches)
    makes micro-batch 8 the planner's pick by far more than nominal constants do."""
    import numpy as np

    from baige_ray.bench.planner_host import accuracy as host_accuracy
    from baige_ray.bench.planner_host import predict_one_device
    from baige_ray.planner.calibration import Calibration, ChipCalibration, ComputeCurve, shape_key

    spec = ModelSpec(name="llama", num_layers=4, hidden=256, ffn_hidden=688, num_heads=8, seq_len=128,
                     vocab_size=1024, global_batch=8, dtype_bytes=4)
    graph = ResourceGraph.from_descriptor(load_descriptor(SIM_2X4))
    graph = graph.without_devices(np.asarray(graph.device_ids)[1:])
    chip = ChipCalibration(chip="sim-a100", peak_flops=312e12)
    chip.layer[shape_key(spec, 1)] = chip.head[shape_key(spec, 1)] = ComputeCurve(tokens=(128, 1024),
                                                                                   flops_per_s=(1e11, 8e11))
    calibration = Calibration(fingerprint="f", backend="nccl", chips={"sim-a100": chip}, links={}, overlap=0.0,
                              optimizer_s_per_param=1e-10, step_overhead_s=1e-3, host_sharing=1.0)
    calibrated = predict_one_device(spec, graph, calibration, [1, 8])
    nominal = predict_one_device(spec, graph, None, [1, 8])
    assert calibrated[1]["step_s"] > 4 * calibrated[8]["step_s"]
    assert nominal[1]["step_s"] < 3 * nominal[8]["step_s"]
    assert calibrated[8]["memory_gb"] > calibrated[1]["memory_gb"]
    rows = [{"micro_batch": b, "predicted_s": calibrated[b]["step_s"], "measured_s": m,
             "rel_error": calibrated[b]["step_s"] / m - 1} for b, m in ((1, 0.7), (8, 0.14))]
    result = host_accuracy(rows)
    assert (result["pick"], result["fastest"], result["pick_vs_best"]) == (8, 8, 1.0)
    assert result["spearman"] == pytest.approx(1.0)
