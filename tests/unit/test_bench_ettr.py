"""bench ettr end to end without Ray: the recorded phases, the planner's job at one size, both strategies."""

from __future__ import annotations

import argparse

from baige_ray.bench import ettr


def test_recorded_run_prices_both_strategies_on_the_same_faults():
    parser = argparse.ArgumentParser()
    ettr.add_arguments(parser)
    args = parser.parse_args(["--no-measure", "--sizes", "1024", "--days", "20", "--seeds", "2"])
    result = ettr.run(args)
    (row,) = result["sizes"]
    ours, restart = row["baige_ray"], row["restart"]
    assert row["devices"] == 1024 and row["state_gb_per_device"] > 0 and row["step_s"] > 0
    assert ours["faults"] == restart["faults"] > 0  # one trace per seed, faced by both
    assert 0 < restart["ettr"] < ours["ettr"] <= 1
    assert restart["persisted_restores"] == restart["faults"]  # every fault restarts from a checkpoint
    assert result["phases"]["measured"] is False
    assert "assumed" in result and "ettr_16k" not in result
    assert "1024" in ettr.summarize(result)


def test_the_16k_figures_carry_the_keys_the_issue_names():
    parser = argparse.ArgumentParser()
    ettr.add_arguments(parser)
    result = ettr.run(parser.parse_args(["--no-measure", "--sizes", "16384", "--days", "2", "--seeds", "1"]))
    (row,) = result["sizes"]
    assert result["ettr_16k"] == row["baige_ray"]["ettr"] and result["baseline_ettr_16k"] == row["restart"]["ettr"]
