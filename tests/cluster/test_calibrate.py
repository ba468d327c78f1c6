"""`calibrate` on the simulated 2 x 4 cluster: every link tier, overlap, optimizer and compute curves
measured through the worker actors, kept per fingerprint, reused without starting actors, priced by plan."""

import time

from baige_ray.commands.calibrate import describe
from baige_ray.jobs.calibrate import CalibrationRequest, calibrate
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.plan import plan
from baige_ray.planner.report import pricing_text
from baige_ray.runtime.auto_plan import live_graph
from baige_ray.runtime.calibration_store import cache_path, load_calibration
from baige_ray.topology.graph import LinkTier

MODEL = ModelSpec(name="tiny", num_layers=2, hidden=64, ffn_hidden=256, num_heads=4, seq_len=32, vocab_size=128,
                  global_batch=8, dtype_bytes=4)


def test_calibration_measures_every_tier_is_kept_and_reused(sim_cluster, tmp_path):
    graph = live_graph()
    request = CalibrationRequest(models=(MODEL,), tps=(1, 2), micro_batches=(1, 4), message_sizes=(4096, 262144),
                                 repeats=1, iterations=2, compute_window_s=0.1)
    calibration = calibrate(graph, request, directory=tmp_path)
    assert set(calibration.links) == {LinkTier.NVLINK, LinkTier.SAME_RAIL, LinkTier.CROSS_RAIL}
    assert all(fit.bandwidth > 0 and fit.latency_s >= 0 for fit in calibration.links.values())
    assert 0.0 <= calibration.overlap <= 1.0 and calibration.optimizer_s_per_param > 0
    assert calibration.host_sharing >= 1.0  # eight workers share this machine's cores
    assert calibration.backend == "gloo"
    assert {"starting the workers", "loading libraries", "links"} <= set(calibration.seconds)
    curves = calibration.curves(MODEL, 2, 312e12)
    assert curves is not None and len(curves[0].tokens) == 2 and min(curves[0].flops_per_s) > 0
    assert calibration.tensor_parallel_included(MODEL, 2, [312e12], LinkTier.NVLINK)  # TP measured through DTensor
    assert calibration.optimizer_seconds(MODEL, 2, [312e12]) is not None
    # ZeRO-3 measured on the engines that run it: DeepSpeed over all 8 (TP 1), FSDP2 beside TP 2 over 4
    for tp in (1, 2):
        assert calibration.sharding_seconds(MODEL, tp, 8 // tp, [312e12], [32, 128]).shape == (2,)
    # and DeepSpeed's ZeRO-1/2 steps, which the engines run without TP only
    for zero in (1, 2):
        assert calibration.sharding_seconds(MODEL, 1, 8, [312e12], [32], zero=zero).shape == (1,)
        assert calibration.sharding_seconds(MODEL, 2, 4, [312e12], [32], zero=zero) is None
    assert cache_path(calibration.fingerprint, tmp_path).is_file()

    start = time.perf_counter()
    again = calibrate(graph, request, directory=tmp_path)
    assert time.perf_counter() - start < 1.0  # read back, no actor started
    assert again.to_json() == load_calibration(graph, tmp_path).to_json()

    chosen = plan(MODEL, graph, PlanOptions(calibration=again, recompute=("none",)))
    text = pricing_text(chosen)
    assert "measured" in text and "link NVLINK" in text
    assert ("measured compute" in text) == (chosen.tp in (1, 2))  # curves were measured at TP 1 and 2 only
    assert "overlap" in describe(again, str(tmp_path)) and "ZeRO-3" in describe(again, str(tmp_path))
    assert "ZeRO-1" in describe(again, str(tmp_path))


def test_a_single_device_calibration_is_reused(sim_cluster, tmp_path):
    """One device has no links to measure: what was measured is complete, and kept (one GPU's case)."""
    from baige_ray.runtime.auto_plan import first_devices

    graph = first_devices(live_graph(), 1)
    request = CalibrationRequest(repeats=1, iterations=2, compute_window_s=0.05, message_sizes=(4096,))
    calibration = calibrate(graph, request, directory=tmp_path)
    assert calibration.links == {} and calibration.host_sharing == 1.0
    start = time.perf_counter()
    calibrate(graph, request, directory=tmp_path)
    assert time.perf_counter() - start < 1.0  # read back, no actor started
