"""The colocate benchmark's arithmetic: diurnal load, arrivals, busy device-seconds, SLO attainment."""

from __future__ import annotations

import argparse
import statistics

import pytest

from baige_ray.bench.colocate import phase_summary, slo_attainment
from baige_ray.bench.colocate_accounting import busy_device_seconds
from baige_ray.bench.colocate_load import arrival_times, diurnal_rates, request_body
from baige_ray.bench.cli import BENCHMARK_MODULES, register


def test_day_runs_from_trough_to_five_times_trough_and_back():
    rates = diurnal_rates(trough=2.0, peak_ratio=5.0, noise=0.0)
    assert len(rates) == 24
    assert min(rates) == pytest.approx(2.0, rel=0.02) and max(rates) == pytest.approx(10.0, rel=0.02)
    assert rates.index(max(rates)) in (11, 12)
    assert rates[:12] == pytest.approx(rates[12:][::-1])  # symmetric about noon


def test_noise_is_bounded_and_seeded():
    noisy = diurnal_rates(trough=2.0, noise=0.1, seed=3)
    smooth = diurnal_rates(trough=2.0, noise=0.0)
    assert all(0.9 * s - 1e-9 <= n <= 1.1 * s + 1e-9 for n, s in zip(noisy, smooth))
    assert noisy == diurnal_rates(trough=2.0, noise=0.1, seed=3) != diurnal_rates(trough=2.0, noise=0.1, seed=4)
    with pytest.raises(ValueError):
        diurnal_rates(peak_ratio=0.5)


def test_arrivals_follow_each_hours_rate():
    arrivals = arrival_times([5.0, 50.0], hour_s=200.0, seed=1)
    first = [a for a in arrivals if a < 200.0]
    second = [a for a in arrivals if a >= 200.0]
    assert len(first) == pytest.approx(1000, rel=0.1) and len(second) == pytest.approx(10000, rel=0.05)
    assert arrivals == sorted(arrivals) and arrivals[-1] < 400.0
    gaps = [b - a for a, b in zip(second, second[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.02, rel=0.05)
    assert arrivals == arrival_times([5.0, 50.0], hour_s=200.0, seed=1)


def test_busy_device_seconds_integrates_between_samples_inside_the_window():
    samples = [(0.0, 7), (10.0, 0), (12.0, 4), (20.0, 7)]
    assert busy_device_seconds(samples, 0.0, 30.0) == 7 * 10 + 0 * 2 + 4 * 8 + 7 * 10
    assert busy_device_seconds(samples, 5.0, 15.0) == 7 * 5 + 4 * 3
    assert busy_device_seconds([], 0.0, 5.0) == 0.0


def test_slo_attainment_counts_failures_as_misses():
    assert slo_attainment([0.1, 0.2, 0.6, None], 0.5) == 0.5
    assert slo_attainment([0.5], 0.5) == 1.0
    assert slo_attainment([], 0.5) == 1.0


def test_phase_summary_puts_busy_device_seconds_over_the_pool():
    summary = phase_summary(train_busy_s=600.0, infer_busy_s=120.0, wall_s=100.0,
                            latencies=[0.1] * 98 + [2.0, None], slo_s=1.0, train_steps=42)
    assert summary["utilization"] == pytest.approx(0.9)
    assert (summary["slo_attainment"], summary["failed_requests"], summary["train_steps"]) == (0.98, 1, 42)
    assert summary["p99_latency_s"] == 2.0 and summary["requests"] == 100  # 99 answered: p99 is the slowest


def test_requests_are_valid_for_the_generate_route():
    from baige_ray.serving.requests import RequestLimits, parse_generate_request
    import json

    parsed = parse_generate_request(json.dumps(request_body(7, 16)).encode(), RequestLimits())
    assert parsed.seed == 7 and parsed.max_new_tokens == 16


def test_colocate_is_registered_with_its_options():
    assert BENCHMARK_MODULES["colocate"] == "baige_ray.bench.colocate"
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "colocate", "--json", "--hour-s", "2", "--slo-p99-s", "0.5"])
    assert (args.hour_s, args.slo_p99_s, args.json) == (2.0, 0.5, True)


def test_hourly_attainment_buckets_requests_by_send_time():
    from baige_ray.bench.colocate import hourly_attainment

    hourly = hourly_attainment([0.5, 1.5, 1.7, 9.9], [0.1, 0.1, 3.0, None], hour_s=1.0, slo_s=1.0, num_hours=4)
    assert hourly == [1.0, 0.5, 1.0, 0.0]  # the late send lands in the last hour


def _default_args(*extra: str) -> argparse.Namespace:
    from baige_ray.bench.colocate import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(extra))


def test_the_noisy_peak_needs_one_lend_and_the_trough_none():
    from baige_ray.bench.colocate import PEAK_RATIO, _arbiter_config
    from baige_ray.policies.lending import LendingAction, LendingObservation, decide

    args = _default_args()
    args.harvest_share, args.min_infer = 0.0, 1  # whole-device lending alone
    capacity = 30.0
    config = _arbiter_config(args, capacity)
    assert config.train_sizes == (3, 4, 5, 6, 7)  # 5 with shares of 17, 17, 17, 17, 16 of the 84
    assert config.trend_window_s == 3 * args.hour_s

    def decision(rate: float, train: int, infer: int):
        return decide(LendingObservation(
            request_rate=rate, p99_latency_s=0.2, slo_p99_s=args.slo_p99_s, queue_depth=0, train_devices=train,
            infer_devices=infer, min_train_devices=config.min_train_devices, replica_capacity=capacity,
            seconds_since_change=1000.0, train_sizes=config.train_sizes), config.policy)

    peak = args.peak_replicas * capacity * 1.1  # the highest hour: 10% noise over the peak
    lend = decision(peak, 7, 1)
    assert (lend.action, lend.num_devices) == (LendingAction.LEND, 1)  # to 6 + 2, not 4 + 4
    assert decision(peak, 6, 2).action is LendingAction.HOLD
    trough = args.peak_replicas * capacity / PEAK_RATIO * 1.1
    assert decision(trough, 7, 1).action is LendingAction.HOLD
    assert decision(trough, 6, 2).action is LendingAction.RECLAIM


def test_summary_lists_moves_by_simulated_hour():
    from baige_ray.bench.colocate import summarize

    phase = {"utilization": 0.9, "slo_attainment": 0.99, "failed_requests": 0, "train_steps": 10,
             "p99_latency_s": 0.5, "hourly_slo_attainment": [1.0] * 24}
    result = {**phase, "lends": 1, "reclaims": 0, "harvests": 1, "unharvests": 0, "harvested_device_s": 12.0,
              "slo_p99_s": 1.0, "replica_capacity": 30.0, "trough_rate": 6.0,
              "hour_s": 10.0, "moves": [[45.0, "lend", 6, 2, 12.5, 14.2, 19.8, 0], [80.0, "harvest", 6, 2, 2.0, 5.0, None, 2]],
              "load_average": {"before": [1.0, 1.0, 1.0], "after": [2.0, 2.0, 2.0]}, "static": phase,
              "utilization_bound": {"0.47": 0.874, "1.0": 0.936}}
    text = summarize(result)
    assert "(hour  4.5) lend      -> train 6, infer 2 (0 shared) in 12.5s (rate 14.2, forecast 19.8 req/s)" in text
    assert "(hour  8.0) harvest   -> train 6, infer 2 (2 shared) in 2.0s (rate 5.0 req/s)" in text
    assert "12.0 device-s trained beside replicas" in text
    assert "load average before [1.0, 1.0, 1.0]" in text
    assert "0.874 with replicas at most 0.47 busy, 0.936 with replicas at most 1.0 busy" in text


def test_whole_device_bound_charges_the_idle_share_of_the_replicas_the_cap_requires():
    from baige_ray.bench.colocate import whole_device_bound

    # 0.2 of a replica's throughput needs one replica, idle 0.8 of the time: 1 - 0.8/8.
    assert whole_device_bound([0.2], 1.0, busy_cap=0.5) == pytest.approx(1 - 0.8 / 8)
    # 0.8 at a cap of 0.5 needs two replicas: 1.2 idle; at a cap of 1.0 one replica, 0.2 idle.
    assert whole_device_bound([0.8], 1.0, busy_cap=0.5) == pytest.approx(1 - 1.2 / 8)
    assert whole_device_bound([0.8], 1.0, busy_cap=1.0) == pytest.approx(1 - 0.2 / 8)
    # Hours average; training never drops below its minimum, so an overload's replicas are all busy.
    assert whole_device_bound([0.2, 0.8], 1.0, busy_cap=0.5) == pytest.approx(1 - 1.0 / 8)
    assert whole_device_bound([9.0], 1.0, busy_cap=0.5, min_train=3) == 1.0
    with pytest.raises(ValueError, match="busy_cap"):
        whole_device_bound([1.0], 1.0, busy_cap=0.0)


def test_by_default_three_warm_replicas_are_harvested_at_night_and_one_is_given_back_at_noon():
    from baige_ray.bench.colocate import PEAK_RATIO, POOL_DEVICES, _arbiter_config
    from baige_ray.policies.lending import LendingAction, LendingObservation, decide

    args = _default_args()
    capacity = 30.0
    config = _arbiter_config(args, capacity)
    assert config.train_sizes == (3, 4, 5, 6, 7, 8) and config.harvest_share == args.harvest_share
    assert args.min_infer == 3
    train = POOL_DEVICES - args.min_infer

    def decision(rate: float, harvested: int):
        return decide(LendingObservation(
            request_rate=rate, p99_latency_s=0.2, slo_p99_s=args.slo_p99_s, queue_depth=0, train_devices=train,
            infer_devices=args.min_infer, min_train_devices=config.min_train_devices, replica_capacity=capacity,
            seconds_since_change=1000.0, train_sizes=config.train_sizes, harvested_devices=harvested,
            shared_capacity=config.shared_capacity), config.policy)

    trough = args.peak_replicas * capacity / PEAK_RATIO * 1.1
    night = decision(trough, 0)
    assert (night.action, night.num_devices) == (LendingAction.HARVEST, 3)
    peak = args.peak_replicas * capacity * 1.1  # 26.4 req/s: 0.59 of 3 shared devices (1.5 replicas)
    noon = decision(peak, 3)
    assert (noon.action, noon.num_devices) == (LendingAction.UNHARVEST, 1)  # 0.44 of 2 replicas' worth
    assert decision(peak, 2).action is LendingAction.HOLD  # no whole device is lent
