import pytest

from baige_ray.parallel.layout import ParallelLayout, parse_layout


def test_ranks_are_row_major_over_pp_dp_tp():
    layout = ParallelLayout(dp=2, tp=2, pp=2)
    assert [(c.pp, c.dp, c.tp) for c in map(layout.coords, range(8))] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)
    ]


def test_even_and_explicit_stage_sizes():
    assert ParallelLayout(pp=3).layers_per_stage(8) == (3, 3, 2)
    assert ParallelLayout(pp=2, stage_layers=(5, 3)).layers_per_stage(8) == (5, 3)
    with pytest.raises(ValueError, match="sum of 8"):
        ParallelLayout(pp=2, stage_layers=(4, 3)).layers_per_stage(8)


def test_interleaving_gives_each_rank_two_stages():
    layout = ParallelLayout(pp=2, pipeline_schedule="interleaved-1f1b")
    assert layout.num_stages == 4
    assert layout.stage_indices(0) == (0, 2) and layout.stage_indices(1) == (1, 3)


def test_microbatches_must_divide_the_replica_batch():
    assert ParallelLayout(pp=2).microbatches(8) == 4
    with pytest.raises(ValueError, match="num_microbatches=3"):
        ParallelLayout(pp=2, num_microbatches=3).microbatches(8)


def test_zero_needs_pure_data_parallelism():
    with pytest.raises(ValueError, match="data_parallel='zero3' is invalid with tp=2"):
        ParallelLayout(dp=2, tp=2, data_parallel="zero3")


def test_parse_layout():
    assert parse_layout("auto") == "auto"
    assert parse_layout("dp=2,tp=2,pp=2,engine=fsdp2,micro=4") == ParallelLayout(
        dp=2, tp=2, pp=2, data_parallel="fsdp2", num_microbatches=4
    )
    with pytest.raises(ValueError, match="'xp=2' is invalid"):
        parse_layout("xp=2")
    with pytest.raises(ValueError, match="integer"):
        parse_layout("dp=two")


def test_pipeline_run_ahead_is_a_non_negative_integer():
    assert parse_layout("pp=2,ahead=3") == ParallelLayout(pp=2, pipeline_run_ahead=3)
    assert ParallelLayout(pp=2).pipeline_run_ahead == 0
    with pytest.raises(ValueError, match="pipeline_run_ahead=-1 is invalid"):
        ParallelLayout(pp=2, pipeline_run_ahead=-1)
