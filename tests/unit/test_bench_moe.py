"""`baige-ray bench moe`: its arithmetic over per-rank step records, and bad sizes refused up front."""

import argparse

import pytest

from baige_ray.bench import moe


def args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    parsed = parser.parse_args([])
    for name, value in overrides.items():
        setattr(parsed, name, value)
    return parsed


def test_imbalance_is_max_over_mean_of_the_ranks_summed_counts_for_the_worst_layer():
    rank0 = [[4, 0, 2, 2], [2, 2, 2, 2]]
    rank1 = [[4, 0, 2, 2], [2, 2, 2, 2]]
    assert moe.step_imbalance([rank0, rank1]) == pytest.approx(8 / 4)
    assert moe.step_imbalance([rank0, []]) == pytest.approx(4 / 2)  # a TP rank > 0 counts nothing


def test_a_layouts_figures_use_the_slowest_rank_of_each_timed_step():
    job = moe.job_of(args(steps=2, warmup=1, global_batch=4, seq_len=8))
    record = lambda step_s, a2a, loss: {"step_s": step_s, "all_to_all_s": a2a, "loss": loss,  # noqa: E731
                                        "expert_tokens": [[2, 2, 2, 2, 2, 2, 2, 2]]}
    ranks = [[record(9.0, 9.0, 0.0), record(0.5, 0.1, 3.0), record(1.0, 0.2, 2.0)],
             [record(9.0, 9.0, 0.0), record(0.25, 0.2, 5.0), record(0.5, 0.4, 4.0)]]
    figures = moe.summarize_ranks(ranks, job, warmup=1)
    assert figures["step_s"] == pytest.approx(0.75)
    assert figures["tokens_per_s"] == pytest.approx(4 * 8 / 0.75, rel=1e-3)
    assert figures["all_to_all_share"] == pytest.approx((0.2 / 0.5 + 0.4 / 1.0) / 2)
    assert figures["expert_imbalance"] == 1.0
    assert figures["loss_last"] == pytest.approx(3.0)


def test_experts_that_do_not_split_over_the_workers_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"ParallelLayout.ep=3 is invalid: expected a divisor of MoEConfig.num_experts=8"):
        moe.run(args(workers=3))
