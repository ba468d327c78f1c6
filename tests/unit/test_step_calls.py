import pytest

from baige_ray.jobs.fit import StepCalls, reduce_step_metrics


def test_first_call_runs_one_step_then_about_a_second_of_steps():
    calls = StepCalls(0, 100, target_s=1.0, most=16)
    assert calls.next() == (0, 1)
    calls.observe(0.25)
    assert calls.next() == (1, 4)
    calls.observe(0.01)
    assert calls.next() == (5, 16)  # capped at `most`
    calls.observe(3.0)
    assert calls.next() == (21, 1)  # a step longer than the target: one per call
    assert calls.remaining == 78


def test_calls_end_exactly_at_the_last_step():
    calls = StepCalls(10, 13, target_s=1.0, most=16)
    calls.observe(0.1)
    assert calls.next() == (10, 3)
    assert calls.remaining == 0
    assert calls.next() == (13, 0)


def test_invalid_call_sizes_are_refused():
    with pytest.raises(ValueError, match="target_s"):
        StepCalls(0, 4, target_s=0.0)
    with pytest.raises(ValueError, match="most"):
        StepCalls(0, 4, most=0)


def test_a_step_takes_the_ranks_mean_time_and_its_loss_is_the_mean_of_those_that_see_it():
    per_rank = [
        {"step": 3, "loss": None, "learning_rate": 0.1, "tokens": 0, "rank_step_s": 0.30},
        {"step": 3, "loss": 2.0, "learning_rate": 0.1, "tokens": 64, "rank_step_s": 0.25},
        {"step": 3, "loss": 4.0, "learning_rate": 0.1, "tokens": 64, "rank_step_s": 0.20},
    ]
    metrics = reduce_step_metrics(per_rank)
    assert (metrics.step, metrics.loss, metrics.tokens, metrics.step_time_s) == (3, 3.0, 128, pytest.approx(0.25))
