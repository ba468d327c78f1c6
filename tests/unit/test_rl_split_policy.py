"""The split GRPO run's device policy (policies/rl_split.py) on hand-computed cases."""

from __future__ import annotations

import pytest

from baige_ray.policies.rl_split import PhaseSample, SplitObservation, candidate_splits, decide_split, fit_phase
from baige_ray.rl.split_sizing import SplitSizer, SplitSizing, pool_devices_for


def observe(rollout, training, *, replicas=1, workers=2, pool=3, left=100, cost=5.0, **extra) -> SplitObservation:
    return SplitObservation(rollout=tuple(PhaseSample(*s) for s in rollout),
                            training=tuple(PhaseSample(*s) for s in training), replicas=replicas, workers=workers,
                            pool_devices=pool, train_sizes=extra.pop("sizes", (1, 2)),
                            max_replicas=extra.pop("max_replicas", 4), iterations_left=left, move_cost_s=cost, **extra)


def test_a_phase_measured_at_one_size_is_taken_as_all_parallel():
    model = fit_phase([PhaseSample(2, 0.4), PhaseSample(2, 0.5), PhaseSample(2, 0.45)])  # median 0.45
    assert (model.serial, model.parallel) == (0.0, pytest.approx(0.9))


def test_two_sizes_fit_the_serial_and_the_parallel_part():
    model = fit_phase([PhaseSample(1, 1.0), PhaseSample(2, 0.6)])  # 0.2 + 0.8 / n
    assert (model.serial, model.parallel) == (pytest.approx(0.2), pytest.approx(0.8))
    assert model.seconds(4) == pytest.approx(0.4)


def test_a_phase_more_devices_did_not_speed_is_all_serial():
    model = fit_phase([PhaseSample(1, 0.5), PhaseSample(2, 0.55)])
    assert (model.serial, model.parallel) == (pytest.approx(0.525), 0.0)


def test_a_rollout_bound_run_moves_a_worker_to_a_replica():
    # (1, 2) now: 0.9 + 0.2 = 1.1 s; (2, 1): 0.45 + 0.4 = 0.85 s; (1, 1): 1.3 s
    decision = decide_split(observe([(1, 0.9)], [(2, 0.2)]))
    assert (decision.replicas, decision.workers) == (2, 1)
    assert (decision.predicted_s, decision.current_s) == (pytest.approx(0.85), pytest.approx(1.1))
    assert decision.moves_from(1, 2)


def test_a_saving_that_does_not_pay_for_the_move_holds():
    # 0.25 s saved x 10 iterations = 2.5 s, under the 5 s a move costs
    decision = decide_split(observe([(1, 0.9)], [(2, 0.2)], left=10))
    assert (decision.replicas, decision.workers) == (1, 2) and "costs" in decision.reason


def test_a_saving_under_min_gain_holds():
    # (2, 1): 0.25 + 0.4 = 0.65 against 0.5 + 0.2 = 0.7: 7% saved, under 10%
    decision = decide_split(observe([(1, 0.5)], [(2, 0.2)]))
    assert not decision.moves_from(1, 2) and "min_gain" in decision.reason


def test_a_balanced_split_holds():
    decision = decide_split(observe([(1, 0.3)], [(2, 0.3)]))
    assert not decision.moves_from(1, 2) and decision.reason.startswith("the split is the best")


def test_a_free_device_goes_to_the_phase_it_speeds_most():
    # pool 4 holds (1, 2) and one idle device: (2, 2) = 0.45 + 0.2 against 0.9 + 0.2
    decision = decide_split(observe([(1, 0.9)], [(2, 0.2)], pool=4, sizes=(1, 2, 4)))
    assert (decision.replicas, decision.workers) == (2, 2)


def test_a_move_that_did_not_speed_the_rollout_is_undone():
    # two replicas took as long as one: the rollout is all serial, and the worker is worth more back
    decision = decide_split(observe([(1, 0.9), (2, 0.9)], [(2, 0.2), (1, 0.4)], replicas=2, workers=1))
    assert (decision.replicas, decision.workers) == (1, 2)


def test_replicas_stop_at_one_per_group_and_workers_at_the_jobs_sizes():
    splits = candidate_splits(observe([(1, 1.0)], [(2, 0.1)], pool=8, sizes=(2, 4), max_replicas=3))
    assert splits == [(1, 2), (1, 4), (2, 2), (2, 4), (3, 2), (3, 4)]


def test_nothing_measured_holds():
    assert decide_split(observe([], [])).reason == "nothing measured yet"


@pytest.mark.parametrize("field, value", [("pool_devices", 0), ("iterations_left", -1), ("min_gain", 2.0),
                                          ("train_sizes", ())])
def test_invalid_observations_name_the_field(field, value):
    arguments = dict(rollout=(), training=(), replicas=1, workers=1, pool_devices=2, train_sizes=(1,),
                     max_replicas=2, iterations_left=1, move_cost_s=1.0)
    with pytest.raises(ValueError, match=field):
        SplitObservation(**{**arguments, field: value})


class Pool:
    """Records the order in which the two sides are asked to change."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def scale(self, num_replicas: int) -> None:
        self.calls.append(("replicas", num_replicas))

    def resize(self, num_workers: int, *, reason: str = "") -> int:
        self.calls.append(("workers", num_workers))
        return num_workers


def sizer(replicas: int, workers: int) -> SplitSizer:
    return SplitSizer(SplitSizing(move_cost_s=5.0), pool_devices=3, train_sizes=(1, 2), max_replicas=4,
                      num_iterations=100, replicas=replicas, workers=workers)


def test_the_side_giving_devices_up_does_so_before_the_other_takes_them():
    to_replicas, to_workers = sizer(1, 2), sizer(2, 1)
    for side, rollout, training in ((to_replicas, 0.9, 0.2), (to_workers, 0.05, 0.6)):
        side.record(rollout, training)
    pool = Pool()
    to_replicas.move(3, to_replicas.decide(3), pool, pool)
    assert pool.calls == [("workers", 1), ("replicas", 2)]
    pool.calls.clear()
    to_workers.move(3, to_workers.decide(3), pool, pool)
    assert pool.calls == [("replicas", 1), ("workers", 2)]
    (move,) = to_workers.moves
    assert (move.after_iteration, move.replicas, move.workers) == (3, (2, 1), (1, 2))
    assert (to_workers.replicas, to_workers.workers) == (1, 2) and to_workers.move_cost_s() == move.seconds


def test_the_pool_a_split_run_sizes_is_the_clusters_devices_less_spares_and_the_reference():
    assert pool_devices_for(SplitSizing(), 8.0, spares=1, spare_share=1.0, reference_share=0.25) == 6
    assert pool_devices_for(SplitSizing(pool_devices=3), 8.0, spares=1, spare_share=1.0, reference_share=0.0) == 3
    with pytest.raises(ValueError, match="SplitSizing.pool_devices"):
        pool_devices_for(SplitSizing(), 0.0, spares=0, spare_share=1.0, reference_share=0.0)


def test_sizing_a_colocated_run_is_refused():
    from baige_ray.rl.trainer import RolloutOptions

    with pytest.raises(ValueError, match="RolloutOptions.sizing"):
        RolloutOptions(num_replicas=2, placement="colocated", sizing=SplitSizing())


def test_an_iterations_groups_are_dealt_evenly_to_the_replicas_within_a_batch():
    from baige_ray.rl.rollouts import deal_shares

    assert deal_shares([8] * 4, num_replicas=2) == [[0, 2], [1, 3]]
    assert deal_shares([8] * 2, num_replicas=3) == [[0], [1]]  # a replica without a group gets no call
    assert deal_shares([8] * 4, num_replicas=1, max_share=16) == [[0, 2], [1, 3]]  # two batches, the second waits
    assert deal_shares([8] * 5, num_replicas=2, max_share=64) == [[0, 2, 4], [1, 3]]
