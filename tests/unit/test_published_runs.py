"""examples/models/published-runs.yaml and baige_ray.bench.published: the rows load, their layouts fill their
GPUs, and every row gets a finite prediction. Error magnitudes are reported, not asserted."""

from __future__ import annotations

import math

import pytest

from baige_ray.bench.published import (
    RUNS_PATH,
    compare_published,
    load_runs,
    model_spec,
    paper_flops,
    reported_step_s,
    summarize,
)
from baige_ray.planner.memory import RECOMPUTE

ROW_KEYS = {"name", "gpus", "layout", "recompute", "micro_batch", "micro_batch_stated", "mapping",
            "predicted_step_s", "reported_step_s", "rel_error", "predicted_tflops_per_gpu",
            "reported_tflops_per_gpu", "memory_ratio", "breakdown", "pick", "note"}
PICK_KEYS = {"layout", "step_s", "matches_reported_tp_pp", "zero", "micro_batch", "recompute", "mapping"}


@pytest.fixture(scope="module")
def result() -> dict:
    return compare_published()


def test_every_row_fills_its_gpus_and_names_its_source():
    runs = load_runs()
    assert len(runs) >= 10
    for run in runs:
        layout = run["layout"]
        assert layout["tp"] * layout["pp"] * layout["dp"] == run["gpus"], run["name"]
        assert layout["recompute"] in RECOMPUTE
        assert run["citation"]["arxiv"] and run["citation"]["where"]
        assert run["reported_flops_counting"] and run["verified"]
        assert run["model"]["dtype_bytes"] == 2
        model = model_spec(run)
        assert model.global_batch % layout["dp"] == 0 and model.num_layers % layout["pp"] == 0


def test_reported_step_uses_the_papers_own_flop_count():
    by_name = {run["name"]: run for run in load_runs()}
    trillion = by_name["megatron-1008b"]  # 502 PFLOP/s aggregate on 3072 GPUs at 163 TFLOP/s each
    step = reported_step_s(trillion)
    assert paper_flops(trillion) / step / 1e15 == pytest.approx(3072 * 163 / 1000)
    gpt3 = by_name["korthikanti-175b-selective"]  # eq. 7 model FLOPs at 13.75 s reproduce the 51.4% MFU
    assert paper_flops(gpt3) / (reported_step_s(gpt3) * 64 * 312e12) == pytest.approx(0.514, abs=0.001)


def test_compare_published_gives_finite_predictions_for_every_row(result):
    assert len(result["runs"]) == len(load_runs(RUNS_PATH))
    for row in result["runs"]:
        assert ROW_KEYS <= set(row), row["name"]
        assert PICK_KEYS <= set(row["pick"])
        for key in ("predicted_step_s", "reported_step_s", "rel_error", "predicted_tflops_per_gpu",
                    "reported_tflops_per_gpu"):
            assert math.isfinite(row[key]), (row["name"], key)
        assert row["predicted_step_s"] > 0 and math.isfinite(row["pick"]["step_s"])
        assert all(math.isfinite(v) for v in row["breakdown"].values())
    assert math.isfinite(result["median_abs_rel_error"])
    assert result["max_abs_rel_error"] >= result["median_abs_rel_error"]


def test_summarize_lists_every_run(result):
    text = summarize(result)
    assert all(row["name"] in text for row in result["runs"])
    assert "median" in text
