"""Policies decide without Ray: failures, stragglers, growth and spares."""

from __future__ import annotations

from baige_ray.policies.failure import FailureAction, FailureObservation, decide_failure
from baige_ray.policies.scaling import GrowthObservation, grow_to, spares_to_start
from baige_ray.policies.straggler import (
    relative_loads,
    StragglerAction,
    StragglerObservation,
    decide_straggler,
    persistent_straggler,
    slow_ranks,
)

SIZES = (2, 4, 6, 8)


def failure(**changes) -> FailureObservation:
    base = dict(num_workers=8, num_lost=2, num_spares=0, min_workers=2,
                valid_sizes=SIZES, recoveries_so_far=0, max_recoveries=5)
    return FailureObservation(**{**base, **changes})


def test_spares_replace_lost_ranks_and_keep_the_world_size():
    decision = decide_failure(failure(num_spares=2))
    assert (decision.action, decision.num_workers, decision.num_from_spares) == (FailureAction.REPLACE, 8, 2)


def test_without_enough_spares_the_job_shrinks_to_the_largest_valid_size():
    decision = decide_failure(failure(num_lost=3, num_spares=1))  # 5 survivors + 1 spare
    assert (decision.action, decision.num_workers, decision.num_from_spares) == (FailureAction.SHRINK, 6, 1)


def test_below_min_workers_the_job_waits_for_capacity():
    decision = decide_failure(failure(num_lost=7, min_workers=4))
    assert decision.action is FailureAction.WAIT
    assert "min_workers=4" in decision.reason


def test_too_many_recoveries_fail_the_job():
    assert decide_failure(failure(recoveries_so_far=5)).action is FailureAction.FAIL


def straggler_obs(history, **changes) -> StragglerObservation:
    slowest = max(history[-1]) if history else 1.0
    base = dict(compute_s=tuple(history), threshold=1.5, patience=3, num_spares=0, min_workers=2,
                replica_size=1, valid_sizes=SIZES, step_s=slowest)  # compute-bound: the step is the slowest rank
    return StragglerObservation(**{**base, **changes})


def test_a_rank_slow_in_every_recent_step_is_a_persistent_straggler():
    history = [(1.0, 1.0, 3.0, 1.0)] * 3
    assert persistent_straggler(tuple(history), 1.5, 3) == 2


def test_a_single_slow_step_is_not_a_straggler():
    history = [(1.0, 1.0, 1.0, 1.0), (1.0, 1.0, 3.0, 1.0), (1.0, 1.0, 1.0, 1.0)]
    assert persistent_straggler(tuple(history), 1.5, 3) is None


def test_different_slow_ranks_are_noise_not_a_straggler():
    history = [(3.0, 1.0, 1.0, 1.0), (1.0, 3.0, 1.0, 1.0), (1.0, 1.0, 3.0, 1.0)]
    assert persistent_straggler(tuple(history), 1.5, 3) is None


def test_a_straggler_is_priced_at_its_median_pace_over_the_window_not_its_last_step():
    history = [(1.0, 3.0, 1.0, 1.0), (1.0, 3.0, 1.0, 1.0), (1.0, 1.6, 1.0, 1.0)]
    decision = decide_straggler(straggler_obs(history, num_spares=1, step_s=10.0))
    assert (decision.action, decision.rank) == (StragglerAction.REPLACE, 1)
    assert "3.0x slower" in decision.reason  # its last step alone, 1.6x, costs under 10% of a 10-s step


def test_relative_loads_are_each_ranks_batch_share_over_its_chip_speed():
    # 4 micro-batches on 3 workers: 2, 1, 1. Mean share 4/3.
    assert relative_loads([2, 1, 1], [1.0, 1.0, 1.0]) == (1.5, 0.75, 0.75)
    # Shares in proportion to the chips' speeds: every rank is expected to take as long.
    assert relative_loads([4, 2], [2.0, 1.0]) == (1.0, 1.0)
    # Even shares on a chip half as fast: it is expected to take twice as long as its peer.
    assert relative_loads([3, 3], [0.5, 1.0]) == (4 / 3, 2 / 3)


def test_a_spare_replaces_a_straggler():
    decision = decide_straggler(straggler_obs([(1.0, 1.0, 1.0, 4.0)] * 3, num_spares=1))
    assert (decision.action, decision.rank) == (StragglerAction.REPLACE, 3)


def test_evicting_pays_when_the_rest_at_full_pace_do_more():
    # 4 workers at the straggler's 4 s pace: 1 sample-unit/s; 2 workers at 1 s: 2/s.
    decision = decide_straggler(straggler_obs([(1.0, 1.0, 1.0, 4.0)] * 3))
    assert (decision.action, decision.rank) == (StragglerAction.EVICT, 3)


def test_a_mild_straggler_is_tolerated_when_evicting_loses_throughput():
    # 8 workers at 1.6 s: 5/s; the next valid size, 6 workers at 1 s: 6/s -> evict; with sizes (4, 8): 4/s -> keep.
    history = [(1.0,) * 7 + (1.6,)] * 3
    assert decide_straggler(straggler_obs(history)).action is StragglerAction.EVICT
    assert decide_straggler(straggler_obs(history, valid_sizes=(4, 8))).action is StragglerAction.TOLERATE


def test_a_straggler_that_costs_little_of_the_step_is_tolerated():
    # Forward 1 ms vs 6 ms inside a 100 ms step (communication, overhead): evicting buys 5%.
    history = [(0.001, 0.001, 0.006, 0.001)] * 3
    assert decide_straggler(straggler_obs(history, step_s=0.1)).action is StragglerAction.TOLERATE
    assert decide_straggler(straggler_obs(history, step_s=0.1, num_spares=1)).action is StragglerAction.TOLERATE


def test_min_workers_protects_a_small_job_from_eviction():
    decision = decide_straggler(straggler_obs([(1.0, 4.0)] * 3, min_workers=2))
    assert decision.action is StragglerAction.TOLERATE


def test_growth_uses_warm_spares_up_to_the_target():
    obs = GrowthObservation(num_workers=6, target_workers=8, free_devices=0, num_spares=2, valid_sizes=SIZES)
    assert grow_to(obs) == 8
    assert grow_to(GrowthObservation(num_workers=6, target_workers=8, free_devices=0, num_spares=1,
                                     valid_sizes=SIZES)) == 6
    assert grow_to(GrowthObservation(num_workers=6, target_workers=6, free_devices=4, num_spares=2,
                                     valid_sizes=SIZES)) == 6


def test_spares_start_only_on_free_devices():
    assert spares_to_start(wanted=2, have=0, free_devices=1) == 1
    assert spares_to_start(wanted=2, have=2, free_devices=4) == 0


def test_a_shrink_releases_ranks_slow_over_the_window_slowest_first():
    # Medians over the window: 1.0, 2.1, 1.0, 3.3, 1.1 (of all: 1.1). Rank 1 was fast in one step: not
    # a persistent straggler, but slow enough to go first in a shrink.
    window = ((1.0, 2.1, 1.1, 3.0, 1.1), (1.2, 1.0, 0.9, 3.3, 1.0), (0.9, 2.4, 1.0, 3.5, 1.2))
    assert persistent_straggler(window, threshold=1.5, patience=3) == 3
    assert slow_ranks(window, threshold=1.5, patience=3) == (3, 1)
    assert slow_ranks(window, threshold=3.5, patience=3) == ()
    assert slow_ranks(window[1:], threshold=1.5, patience=3) == ()  # not a window's worth yet
