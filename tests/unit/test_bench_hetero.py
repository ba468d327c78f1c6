import argparse

import pytest

from baige_ray.bench import cli
from baige_ray.bench.hetero import (
    bubble_fraction,
    data_parallel_step_units,
    head_cost_in_layers,
    pipeline_step_units,
    plan_hetero,
    plan_stages,
    ratios,
    speed_proportional_split,
)
from baige_ray.bench.measure import steady_median, steady_throughput
from baige_ray.parallel.layout import ParallelLayout


def test_split_gives_layers_in_proportion_to_speed():
    assert speed_proportional_split(6, (1.0, 0.5)) == (4, 2)
    assert speed_proportional_split(12, (1.0, 0.5)) == (8, 4)
    assert speed_proportional_split(9, (0.5, 1.0)) == (3, 6)
    assert speed_proportional_split(8, (2.0, 1.0, 1.0)) == (4, 2, 2)


@pytest.mark.parametrize("num_layers,stages", [(6, 2), (7, 2), (5, 3), (12, 4)])
def test_split_with_equal_speeds_matches_the_layouts_even_split(num_layers, stages):
    expected = ParallelLayout(pp=stages).layers_per_stage(num_layers)
    assert speed_proportional_split(num_layers, [1.0] * stages) == expected


def test_split_minimises_the_slowest_stage_against_brute_force():
    import itertools

    speeds = (1.0, 0.45, 0.8)
    costs = (0.0, 0.0, 0.3)
    best = min(
        (max((n + c) / s for n, c, s in zip(split, costs, speeds)), split)
        for split in itertools.product(range(1, 11), repeat=3)
        if sum(split) == 12
    )
    split = speed_proportional_split(12, speeds, costs)
    assert sum(split) == 12
    assert max((n + c) / s for n, c, s in zip(split, costs, speeds)) == pytest.approx(best[0])


def test_fixed_cost_moves_a_layer_off_the_stage_that_carries_it():
    assert speed_proportional_split(4, (1.0, 1.0)) == (2, 2)
    assert speed_proportional_split(4, (1.0, 1.0), fixed_costs=(0.0, 1.0)) == (3, 1)


def test_split_keeps_a_layer_per_stage_and_rejects_bad_input():
    assert speed_proportional_split(2, (1.0, 0.01)) == (1, 1)
    with pytest.raises(ValueError, match="cannot fill"):
        speed_proportional_split(1, (1.0, 0.5))
    with pytest.raises(ValueError, match="positive"):
        speed_proportional_split(4, (1.0, 0.0))
    with pytest.raises(ValueError, match="fixed_costs"):
        speed_proportional_split(4, (1.0, 0.5), fixed_costs=(0.0,))


def test_head_cost_is_the_lm_head_over_one_block_in_flops():
    from baige_ray.models.gpt import GPTConfig

    model = GPTConfig(num_layers=6, hidden=256, num_heads=4, seq_len=128)
    # head 2*h*V = 131,072; block 24*h^2 + 4*s*h = 1,703,936 FLOPs per token
    assert head_cost_in_layers(model) == pytest.approx(131_072 / 1_703_936)


def test_pipeline_step_is_sum_of_stages_plus_the_slowest_for_every_other_micro_batch():
    assert pipeline_step_units((4, 2), (1.0, 0.5), (0.0, 0.5), 8) == pytest.approx(4 + 5 + 7 * 5)
    assert pipeline_step_units((3, 3), (1.0, 1.0), (0.0, 0.0), 1) == pytest.approx(6)


def test_plan_puts_the_lm_head_on_the_fast_chip_when_that_shortens_the_step():
    assert plan_stages(6, (1.0, 0.5), head_cost=0.08, num_microbatches=64) == ((0.5, 1.0), (2, 4))
    assert plan_stages(6, (1.0, 0.5), head_cost=0.0, num_microbatches=64) == ((1.0, 0.5), (4, 2))
    assert plan_stages(6, (1.0, 1.0), head_cost=0.08, num_microbatches=64) == ((1.0, 1.0), (3, 3))


def test_plan_beats_or_ties_every_order_and_split_by_brute_force():
    import itertools

    speeds, head, micro = (1.0, 0.45, 0.8), 0.3, 16
    order, layers = plan_stages(10, speeds, head, micro)
    costs = (0.0, 0.0, head)
    best = min(
        pipeline_step_units(split, perm, costs, micro)
        for perm in itertools.permutations(speeds)
        for split in itertools.product(range(1, 9), repeat=3)
        if sum(split) == 10
    )
    assert sorted(order) == sorted(speeds) and sum(layers) == 10
    assert pipeline_step_units(layers, order, costs, micro) == pytest.approx(best)


def test_bubble_fraction_of_1f1b():
    assert bubble_fraction(2, 64) == pytest.approx(1 / 65)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 8) == 0.0


def test_steady_median_drops_warmup():
    assert steady_median([9.0, 5.0, 1.0, 2.0, 3.0], warmup=2) == 2.0
    assert steady_median([4.0, 1.0, 2.0, 3.0, 100.0], warmup=1) == 2.5
    with pytest.raises(ValueError, match="no steady-state"):
        steady_median([1.0, 2.0], warmup=2)
    with pytest.raises(ValueError, match="warmup"):
        steady_median([1.0], warmup=-1)


def test_steady_throughput_is_tokens_over_median_step_time():
    assert steady_throughput([100, 100, 100, 100], [5.0, 0.5, 0.25, 0.5], warmup=1) == pytest.approx(200.0)


def test_benchmarks_are_registered_with_their_options():
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "hetero", "--json", "--microbatches", "16"])
    assert args.microbatches == 16 and args.json
    args = parser.parse_args(["bench", "overhead", "--steps", "12", "--systems", "baige", "torchrun"])
    assert args.steps == 12 and args.systems == ["baige", "torchrun"]


def test_data_parallel_step_waits_for_the_slowest_replica_then_the_all_reduce():
    assert data_parallel_step_units((43, 21), (1.0, 0.5), 6.0) == pytest.approx(43 * 6)
    assert data_parallel_step_units((32, 32), (1.0, 0.5), 6.0, allreduce_units=2.0) == pytest.approx(64 * 6 + 2)


def test_plan_picks_uneven_data_parallel_for_half_speed_chips_and_splits_micro_batches_by_speed():
    plan = plan_hetero(6, (1.0, 0.5), head_cost=0.08, num_microbatches=64)
    assert plan.kind == "data_parallel"
    assert plan.dp_microbatches == (43, 21)  # max(43 / 1.0, 21 / 0.5) = 43 beats (42, 22) -> 44
    assert plan.data_parallel_units == pytest.approx(43 * 6.08)
    assert (plan.pipeline_speeds, plan.stage_layers) == ((0.5, 1.0), (2, 4))
    assert plan.pipeline_units == pytest.approx(pipeline_step_units((2, 4), (0.5, 1.0), (0.0, 0.08), 64))


def test_plan_picks_the_pipeline_when_the_all_reduce_costs_more_than_the_pipeline_loses():
    cheap = plan_hetero(6, (1.0, 0.5), head_cost=0.08, num_microbatches=64, allreduce_units=1.0)
    costly = plan_hetero(6, (1.0, 0.5), head_cost=0.08, num_microbatches=64, allreduce_units=10.0)
    assert (cheap.kind, costly.kind) == ("data_parallel", "pipeline")
    handover = plan_hetero(6, (1.0, 0.5), head_cost=0.08, num_microbatches=64, allreduce_units=10.0,
                           handover_units=0.2)
    assert handover.kind == "data_parallel"  # 64 hand-overs of 0.2 outweigh one all-reduce of 10


def test_ratios_are_against_the_concurrent_ideal_with_the_sequential_one_beside():
    names = ("fast_alone", "slow_alone", "fast_alone_concurrent", "slow_alone_concurrent",
             "pp_uneven", "dp_uneven", "pp_even", "dp_even")
    values = (100.0, 50.0, 80.0, 40.0, 90.0, 117.0, 60.0, 80.0)
    result = ratios({name: {"throughput": value} for name, value in zip(names, values)}, "dp_uneven", "dp_even")
    assert result["ideal_throughput"] == 120.0 and result["ideal_sequential_throughput"] == 150.0
    assert result["ratio"] == pytest.approx(117 / 120, abs=1e-4)
    assert result["ratio_vs_sequential"] == pytest.approx(117 / 150, abs=1e-4)
    assert result["even_split_ratio"] == pytest.approx(80 / 120, abs=1e-4)
    assert result["layouts"]["pp_uneven"]["ratio"] == 0.75
    assert result["measured_slow_speed"] == 0.5 and result["measured_slow_speed_concurrent"] == 0.5
