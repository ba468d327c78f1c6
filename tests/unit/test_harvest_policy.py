"""Harvesting: lightly loaded inference devices also train; rising load gives them back before any lend."""

from __future__ import annotations

import dataclasses

import pytest

from baige_ray.policies.lending import LendingAction, LendingObservation, LendingPolicy, decide

POLICY = LendingPolicy(lend_above=0.8, target_utilization=0.6, reclaim_below=0.3, cooldown_s=10,
                       breach_cooldown_s=3, harvest_below=0.4)
CAPACITY = 10.0  # requests/s per exclusive inference device; a shared one counts as half


def observe(rate: float, *, train: int = 5, infer: int = 3, harvested: int = 0, p99: float = 0.1,
            since: float = 100.0, sizes=None) -> LendingObservation:
    return LendingObservation(
        request_rate=rate, p99_latency_s=p99, slo_p99_s=1.0, queue_depth=0, train_devices=train,
        infer_devices=infer, min_train_devices=2, replica_capacity=CAPACITY, seconds_since_change=since,
        train_sizes=sizes, harvested_devices=harvested, shared_capacity=0.5,
    )


def test_light_load_harvests_every_device_that_keeps_utilization_low():
    decision = decide(observe(3.0), POLICY)  # 3 shared: 3 / 15 = 0.2
    assert (decision.action, decision.num_devices) == (LendingAction.HARVEST, 3)
    partial = decide(observe(10.0), POLICY)  # 1 shared: 10 / 25 = 0.4; 2 shared: 0.5
    assert (partial.action, partial.num_devices) == (LendingAction.HARVEST, 1)


def test_harvest_needs_low_latency_a_valid_training_size_and_the_cooldown():
    assert decide(observe(3.0, p99=0.8), POLICY).action is LendingAction.HOLD
    assert decide(observe(3.0, since=5.0), POLICY).action is LendingAction.HOLD
    limited = decide(observe(3.0, sizes=(5, 6, 7)), POLICY)  # 5 whole + 3 ranks = 8 is not a size
    assert (limited.action, limited.num_devices) == (LendingAction.HARVEST, 2)


def test_rising_load_gives_shared_devices_back_before_lending():
    decision = decide(observe(14.0, harvested=3), POLICY)  # 14 / 15 = 0.93 > 0.8
    assert decision.action is LendingAction.UNHARVEST
    # keeping 1 shared: 14 / 25 = 0.56 <= 0.6 target; keeping 2: 14 / 20 = 0.7
    assert decision.num_devices == 2
    assert decide(observe(30.0, harvested=0), POLICY).action is LendingAction.LEND


def test_a_breach_gives_shared_devices_back_at_once():
    decision = decide(observe(6.0, harvested=3, p99=1.5, since=4.0), POLICY)
    assert decision.action is LendingAction.UNHARVEST and decision.num_devices >= 1
    assert decide(observe(6.0, harvested=3, p99=1.5, since=1.0), POLICY).action is LendingAction.HOLD


def test_with_harvesting_whole_devices_are_not_reclaimed():
    decision = decide(observe(1.0, harvested=3), POLICY)
    assert decision.action is LendingAction.HOLD
    assert decide(observe(1.0, harvested=3), dataclasses.replace(POLICY, harvest_below=None)).action \
        is LendingAction.RECLAIM


def test_a_day_harvests_at_night_and_gives_back_at_noon_without_thrashing():
    train, infer, harvested, since, changes = 5, 3, 0, 1000.0, []
    day = [2.0] * 60 + [6.0 + i * 0.2 for i in range(60)] + [18.0] * 60 + [18.0 - i * 0.25 for i in range(60)]
    for rate in day:
        decision = decide(observe(rate, train=train, infer=infer, harvested=harvested, since=since), POLICY)
        if decision.action is LendingAction.HARVEST:
            harvested += decision.num_devices
        elif decision.action is LendingAction.UNHARVEST:
            harvested -= decision.num_devices
        else:
            assert decision.action is LendingAction.HOLD, decision
        since = 0.0 if decision.action is not LendingAction.HOLD else since + 1.0
        if decision.action is not LendingAction.HOLD:
            changes.append((round(rate, 1), decision.action, decision.num_devices))
        assert 0 <= harvested <= infer
    assert changes[0][1] is LendingAction.HARVEST and harvested == 3  # night again: all shared
    assert any(action is LendingAction.UNHARVEST for _, action, _ in changes)
    assert len(changes) <= 8, changes


def test_invalid_harvest_settings_are_refused():
    with pytest.raises(ValueError, match="harvest_below"):
        LendingPolicy(lend_above=0.8, target_utilization=0.6, reclaim_below=0.3, harvest_below=0.9)
    with pytest.raises(ValueError, match="harvested_devices"):
        observe(1.0, infer=1, harvested=2)
    with pytest.raises(ValueError, match="shared_capacity"):
        dataclasses.replace(observe(1.0), shared_capacity=0.0)
