"""Lending policy: lend on rising load or an SLO breach, reclaim on falling load, never thrash."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from baige_ray.policies.lending import LendingAction, LendingObservation, LendingPolicy, decide, forecast_rate

POLICY = LendingPolicy(lend_above=0.8, target_utilization=0.6, reclaim_below=0.45, cooldown_s=10, breach_cooldown_s=3)
CAPACITY = 10.0  # requests/s per inference device


def observe(rate: float, *, train: int = 7, infer: int = 1, p99: float = 0.1, since: float = 100.0,
            queue: int = 0, per_replica: int = 1, min_train: int = 2, sizes=None,
            forecast: float | None = None) -> LendingObservation:
    return LendingObservation(
        request_rate=rate, p99_latency_s=p99, slo_p99_s=1.0, queue_depth=queue, train_devices=train,
        infer_devices=infer, min_train_devices=min_train, replica_capacity=CAPACITY,
        seconds_since_change=since, devices_per_train_replica=per_replica, train_sizes=sizes,
        forecast_rate=forecast,
    )


class Pool:
    """Replays a load trace through the policy, applying each decision, one observation per second."""

    def __init__(self, train: int = 7, infer: int = 1, per_replica: int = 1):
        self.train, self.infer, self.per_replica = train, infer, per_replica
        self.since, self.changes = 1000.0, []

    def step(self, rate: float, p99: float = 0.1) -> None:
        decision = decide(observe(rate, train=self.train, infer=self.infer, p99=p99, since=self.since,
                                  per_replica=self.per_replica), POLICY)
        sign = {LendingAction.LEND: 1, LendingAction.RECLAIM: -1, LendingAction.HOLD: 0}[decision.action]
        assert decision.num_devices % self.per_replica == 0
        self.train -= sign * decision.num_devices
        self.infer += sign * decision.num_devices
        self.since = 0.0 if sign else self.since + 1.0
        if sign:
            self.changes.append((decision.action, decision.num_devices))


def test_steady_load_holds():
    pool = Pool(train=6, infer=2)
    for _ in range(300):
        pool.step(12.0)  # 0.6 of two devices: inside the band
    assert pool.changes == [] and (pool.train, pool.infer) == (6, 2)


def test_rising_load_lends_enough_to_reach_the_target():
    decision = decide(observe(25.0, infer=2), POLICY)  # utilization 1.25
    assert decision.action is LendingAction.LEND
    assert decision.num_devices == math.ceil(25 / (CAPACITY * 0.6)) - 2 == 3


def test_rising_ramp_lends_step_by_step_and_ends_inside_the_band():
    pool = Pool()
    for second in range(141):
        pool.step(1.0 + 0.25 * second)  # 1 -> 36 requests/s
    assert all(action is LendingAction.LEND for action, _ in pool.changes)
    assert len(pool.changes) >= 2
    assert 36 / (pool.infer * CAPACITY) <= POLICY.lend_above
    assert pool.train + pool.infer == 8


def test_falling_load_reclaims_back_to_the_minimum():
    pool = Pool(train=2, infer=6)
    for second in range(200):
        pool.step(max(1.0, 40.0 - 0.5 * second))
    assert all(action is LendingAction.RECLAIM for action, _ in pool.changes)
    assert (pool.train, pool.infer) == (7, 1)


def test_oscillating_load_near_the_threshold_does_not_thrash():
    rng = random.Random(0)
    pool = Pool(train=6, infer=2)
    for second in range(600):
        pool.step(16.0 + 2.0 * math.sin(second / 3) + rng.uniform(-1.5, 1.5))  # around 0.8 of two devices
    assert len(pool.changes) <= 1  # at most one lend, after which the load sits well inside the band


def test_square_wave_changes_at_most_once_per_cooldown():
    pool = Pool(train=6, infer=2)
    for second in range(300):
        pool.step(30.0 if (second // 2) % 2 else 3.0)  # flips every 2 s, faster than the cool-down
    assert len(pool.changes) <= 300 / POLICY.cooldown_s


def test_slo_breach_lends_at_once_even_inside_the_cooldown():
    decision = decide(observe(5.0, infer=2, p99=1.5, since=4.0), POLICY)
    assert decision.action is LendingAction.LEND and decision.num_devices >= 1
    assert "p99" in decision.reason


def test_breach_right_after_a_change_waits_for_it_to_take_effect():
    assert decide(observe(5.0, infer=2, p99=1.5, since=1.0), POLICY).action is LendingAction.HOLD


def test_deep_queue_counts_as_a_breach():
    decision = decide(observe(5.0, infer=1, queue=POLICY.queue_per_device + 1, since=5.0), POLICY)
    assert decision.action is LendingAction.LEND


def test_training_never_goes_below_its_minimum():
    decision = decide(observe(100.0, train=2, infer=6, p99=3.0), POLICY)
    assert decision.action is LendingAction.HOLD and "minimum" in decision.reason
    assert decide(observe(100.0, train=4, infer=4, min_train=3), POLICY).num_devices == 1


def test_training_shrinks_and_grows_by_whole_data_parallel_replicas():
    lend = decide(observe(17.0, train=6, infer=2, per_replica=2), POLICY)  # wants 3: one more device
    assert (lend.action, lend.num_devices) == (LendingAction.LEND, 2)
    reclaim = decide(observe(1.0, train=4, infer=4, per_replica=2), POLICY)
    assert (reclaim.action, reclaim.num_devices) == (LendingAction.RECLAIM, 2)  # keeps one device: min 1
    assert decide(observe(1.0, train=4, infer=3, per_replica=2), POLICY).num_devices == 2


def test_only_sizes_training_can_run_at_are_chosen():
    sizes = (1, 2, 3, 4, 6, 7)  # data-parallel degrees that split a global batch of 84
    lend = decide(observe(17.0, train=7, infer=1, sizes=sizes), POLICY)  # wants 3: 2 more; 5 is not a size
    assert (lend.action, lend.num_devices) == (LendingAction.LEND, 3)
    small = decide(observe(9.0, train=7, infer=1, sizes=sizes), POLICY)  # wants 2: one more, 6 is a size
    assert small.num_devices == 1
    reclaim = decide(observe(1.0, train=4, infer=4, sizes=sizes), POLICY)
    assert (reclaim.action, reclaim.num_devices) == (LendingAction.RECLAIM, 3)  # back to 7, not 8
    partial = decide(observe(100.0, train=7, infer=1, sizes=(4, 7), p99=2.0), POLICY)
    assert partial.num_devices == 3  # all the way to the smallest size there is


def test_no_reclaim_while_latency_is_near_the_objective():
    assert decide(observe(1.0, train=4, infer=4, p99=0.9), POLICY).action is LendingAction.HOLD


def test_inside_cooldown_holds():
    assert decide(observe(30.0, infer=2, since=5.0), POLICY).action is LendingAction.HOLD


def test_invalid_policy_and_observation_are_refused():
    with pytest.raises(ValueError, match="hysteresis"):
        LendingPolicy(lend_above=0.5, target_utilization=0.6, reclaim_below=0.4)
    with pytest.raises(ValueError, match="replica_capacity"):
        dataclasses.replace(observe(1.0), replica_capacity=0.0)
    with pytest.raises(ValueError, match="queue_depth"):
        dataclasses.replace(observe(1.0), queue_depth=-1)


def test_forecast_extrapolates_the_trend():
    line = [(t, 2.0 + 0.5 * t) for t in range(10)]
    assert forecast_rate(line, 20.0) == pytest.approx(12.0)
    assert forecast_rate([(t, 7.0) for t in range(10)], 100.0) == pytest.approx(7.0)
    noisy = [(t, 2.0 + 0.5 * t + (0.3 if t % 2 else -0.3)) for t in range(20)]
    assert forecast_rate(noisy, 30.0) == pytest.approx(17.0, abs=0.3)


def test_forecast_needs_a_span_and_is_never_negative():
    assert forecast_rate([], 5.0) is None and forecast_rate([(1.0, 3.0)], 5.0) is None
    assert forecast_rate([(0.0, 3.0), (0.5, 4.0)], 5.0, min_span_s=1.0) is None
    assert forecast_rate([(0.0, 10.0), (10.0, 5.0)], 100.0) == 0.0


def test_rising_forecast_lends_before_the_load_arrives():
    assert decide(observe(7.0, infer=1), POLICY).action is LendingAction.HOLD  # 0.7 now: inside the band
    early = decide(observe(7.0, infer=1, forecast=14.0), POLICY)
    assert (early.action, early.num_devices) == (LendingAction.LEND, math.ceil(14 / (CAPACITY * 0.6)) - 1)


def test_no_reclaim_while_the_forecast_still_needs_the_devices():
    assert decide(observe(3.0, train=4, infer=4), POLICY).action is LendingAction.RECLAIM
    assert decide(observe(3.0, train=4, infer=4, forecast=30.0), POLICY).action is LendingAction.HOLD
    falling = decide(observe(3.0, train=4, infer=4, forecast=1.0), POLICY)  # below now: the rate now counts
    assert falling.action is LendingAction.RECLAIM and falling.num_devices == 3


def _overloaded_seconds(use_forecast: bool, lend_latency_s: int = 15) -> int:
    """Replay a ramp from 2 to 38 requests/s over 120 s, one observation a second; a lend's devices
    serve only lend_latency_s after the decision. Returns the seconds serving was short of the load."""
    train, infer, since, history, arriving, short = 7, 1, 1000.0, [], [], 0
    for second in range(120):
        rate = 2.0 + 0.3 * second
        history = [*history, (float(second), rate)][-30:]
        serving = infer - sum(n for at, n in arriving if at > second)
        short += rate > serving * CAPACITY
        forecast = forecast_rate(history, second + lend_latency_s) if use_forecast else None
        decision = decide(observe(rate, train=train, infer=infer, since=since, forecast=forecast), POLICY)
        since = 0.0 if decision.action is not LendingAction.HOLD else since + 1.0
        if decision.action is LendingAction.LEND:
            train, infer = train - decision.num_devices, infer + decision.num_devices
            arriving.append((second + lend_latency_s, decision.num_devices))
    return short


def test_a_slow_lend_keeps_up_with_a_ramp_only_with_the_forecast():
    assert _overloaded_seconds(use_forecast=False) > 0
    assert _overloaded_seconds(use_forecast=True) == 0


def test_a_breach_at_light_load_is_a_stall_not_a_shortage():
    gated = dataclasses.replace(POLICY, breach_min_utilization=0.4)
    stall = decide(observe(6.0, infer=2, p99=1.5, since=50.0), gated)  # 0.3 of two devices
    assert stall.action is LendingAction.HOLD and "stall" in stall.reason
    assert decide(observe(6.0, infer=2, p99=1.5, since=50.0), POLICY).action is LendingAction.LEND
    loaded = decide(observe(9.0, infer=2, p99=1.5, since=50.0), gated)  # 0.45: a real shortage
    assert loaded.action is LendingAction.LEND
    assert decide(observe(6.0, infer=2, p99=0.1, since=50.0, forecast=9.0), gated).action is LendingAction.HOLD
    assert decide(observe(6.0, infer=2, p99=1.5, since=50.0, forecast=9.0), gated).action is LendingAction.LEND


def test_a_hold_at_low_utilization_says_why_nothing_goes_back():
    observation = LendingObservation(request_rate=0.1, p99_latency_s=0.1, slo_p99_s=1.0, queue_depth=0,
                                     train_devices=4, infer_devices=1, min_train_devices=3, replica_capacity=10.0,
                                     seconds_since_change=100.0, min_infer_devices=1)
    decision = decide(observation, LendingPolicy())
    assert decision.action is LendingAction.HOLD and "minimum of 1" in decision.reason
