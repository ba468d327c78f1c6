"""Request accounting the arbiter decides on: rate, p99, queue depth, busy seconds."""

from __future__ import annotations

import pytest

from baige_ray.policies.disaggregation import SideLoad
from baige_ray.serving.ledger import STALE_AFTER_S, EngineLoad, RequestLedger, percentile


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 0.99) == 99
    assert percentile(values, 1.0) == 100
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([], 0.99) == 0.0
    with pytest.raises(ValueError):
        percentile(values, 0)


def test_window_counts_only_recent_requests_and_live_replicas():
    ledger = RequestLedger()
    ledger.record("a", now=100.0, latencies=[0.1] * 10, busy_s=1.0, ongoing=2)
    ledger.record("b", now=108.0, latencies=[0.2] * 99 + [0.9], busy_s=0.5, ongoing=3)
    window = ledger.window(now=110.0, window_s=5.0)
    assert window.num_requests == 100
    assert window.request_rate == pytest.approx(20.0)
    assert window.p99_latency_s == 0.2  # the one slow request in 100 is the 100th percentile, not the 99th
    # "a" last reported 10 s ago: stale, so its queue no longer counts.
    assert (window.queue_depth, window.num_replicas) == (3, 1)
    assert ledger.live_replicas(108.0 + STALE_AFTER_S) == ["b"]


def test_busy_seconds_and_requests_accumulate_per_replica():
    ledger = RequestLedger()
    for now in (1.0, 2.0, 3.0):
        ledger.record("a", now=now, latencies=[0.1, 0.1], busy_s=0.25, ongoing=0)
    assert ledger.busy_seconds() == {"a": 0.75}
    assert ledger.requests_served() == 6


def test_old_latencies_are_forgotten():
    ledger = RequestLedger(keep_s=10.0)
    ledger.record("a", now=0.0, latencies=[5.0], busy_s=0.0, ongoing=0)
    ledger.record("a", now=20.0, latencies=[0.1], busy_s=0.0, ongoing=0)
    assert ledger.window(now=20.0, window_s=100.0).p99_latency_s == 0.1


def test_requests_per_busy_second_over_the_window():
    ledger = RequestLedger()
    ledger.record("a", now=1.0, latencies=[0.1] * 4, busy_s=2.0, ongoing=0)
    ledger.record("a", now=9.0, latencies=[0.1] * 6, busy_s=0.5, ongoing=0)
    ledger.record("b", now=10.0, latencies=[0.1] * 4, busy_s=0.5, ongoing=0)
    window = ledger.window(now=10.0, window_s=5.0)
    assert window.busy_s == 1.0
    assert window.requests_per_busy_s == 10.0
    assert ledger.window(now=100.0, window_s=5.0).requests_per_busy_s is None


def test_side_loads_sum_each_roles_live_engines():
    ledger = RequestLedger()
    ledger.record("p1", now=100.0, latencies=[], busy_s=0.1, ongoing=0, engine=EngineLoad("prefill", 3, 2))
    ledger.record("p2", now=100.0, latencies=[], busy_s=0.1, ongoing=0, engine=EngineLoad("prefill", 1, 0))
    ledger.record("d1", now=101.0, latencies=[0.2], busy_s=0.4, ongoing=9, engine=EngineLoad("decode", 0, 9))
    ledger.record("gone", now=90.0, latencies=[], busy_s=0.0, ongoing=5, engine=EngineLoad("decode", 5, 0))
    assert ledger.side_loads(now=101.0) == {
        "decode": SideLoad(num_replicas=1, num_waiting=0, num_running=9),
        "prefill": SideLoad(num_replicas=2, num_waiting=4, num_running=2),
    }
