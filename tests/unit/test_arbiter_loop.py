"""The pool arbiter's decision loop against in-process training and serving sides."""

from __future__ import annotations

import pytest

from baige_ray.actors.arbiter import ArbiterConfig, ArbiterLoop
from baige_ray.ops.events import EventLog, read_events
from baige_ray.policies.lending import LendingAction, LendingPolicy

POLICY = LendingPolicy(cooldown_s=10, breach_cooldown_s=3)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Training:
    """Holds `devices`; resize may be told to fall short (a replica that could not be placed)."""

    def __init__(self, calls: list, devices: int = 7):
        self.calls, self.devices, self.running, self.shortfall, self.step = calls, devices, True, 0, 40

    def num_devices(self) -> int:
        return self.devices

    def is_running(self) -> bool:
        return self.running

    def resize(self, num_devices: int, reason: str) -> int:
        self.calls.append(("resize", num_devices))
        self.devices = num_devices + (self.shortfall if num_devices < self.devices else -self.shortfall)
        return self.devices

    def latest_model_state(self):
        self.calls.append(("latest_model_state", self.step))
        return self.step, f"ref@{self.step}"


class Serving:
    def __init__(self, calls: list, replicas: int = 1):
        self.calls, self.replicas = calls, replicas
        self.rate, self.p99, self.queue = 1.0, 0.05, 0
        self.measured_capacity = None
        self.moves: list[str] = []
        self.rebalances = 0

    def num_replicas(self) -> int:
        return self.replicas

    def load(self, window_s: float) -> dict:
        return {"request_rate": self.rate, "p99_latency_s": self.p99, "queue_depth": self.queue,
                "num_requests": int(self.rate * window_s), "requests_per_busy_s": self.measured_capacity}

    def scale(self, num_replicas: int) -> None:
        self.calls.append(("scale", num_replicas))
        self.replicas = num_replicas

    def reload(self, step, state_ref) -> None:
        self.calls.append(("reload", state_ref))

    def rebalance(self) -> str | None:
        """A disaggregated application moves replicas between its sides when `moves` says so."""
        self.rebalances += 1
        return self.moves.pop(0) if self.moves else None

    def return_idle_memory(self) -> int:
        self.calls.append(("return_idle_memory",))
        return 12 << 20


@pytest.fixture
def pool(tmp_path):
    calls: list = []
    training, serving, clock = Training(calls), Serving(calls), Clock()
    config = ArbiterConfig(slo_p99_s=0.5, replica_capacity=10.0, min_train_devices=2, policy=POLICY,
                           event_log=tmp_path / "events.jsonl")
    loop = ArbiterLoop(training, serving, config, clock=clock)
    return loop, training, serving, clock, calls


def test_lend_shrinks_training_then_starts_replicas_with_the_newest_weights(pool):
    loop, training, serving, clock, calls = pool
    serving.rate = 15.0  # 1.5x what one replica sustains
    assert loop.tick().action is LendingAction.LEND
    # Replicas start one at a time, so the running ones are not starved by several starting at once.
    assert calls == [("resize", 5), ("latest_model_state", 40), ("reload", "ref@40"), ("scale", 2), ("scale", 3)]
    assert (loop.train_devices, loop.infer_devices, training.devices + serving.replicas) == (5, 3, 8)


def test_reclaim_drains_replicas_before_training_grows(pool):
    loop, training, serving, clock, calls = pool
    training.devices, serving.replicas = 4, 4
    loop = ArbiterLoop(training, serving, loop.config, clock=clock)
    serving.rate = 2.0
    assert loop.tick().action is LendingAction.RECLAIM
    assert calls == [("scale", 1), ("resize", 7)]
    assert (loop.train_devices, loop.infer_devices) == (7, 1)


def test_events_carry_the_device_split(pool):
    loop, training, serving, clock, calls = pool
    serving.rate = 15.0
    loop.tick()
    clock.now += 60
    serving.rate = 0.5
    loop.tick()
    events = read_events(loop.config.event_log)
    assert [(e["kind"], e["train_devices"], e["infer_devices"], e["num_devices"]) for e in events] == [
        ("lend", 5, 3, 2), ("reclaim", 7, 1, 2)]
    assert "utilization" in events[0]["reason"]


def test_cooldown_spaces_changes_and_a_breach_cuts_it_short(pool):
    loop, training, serving, clock, calls = pool
    serving.rate = 15.0
    loop.tick()
    serving.rate = 40.0  # more load right away: inside the cool-down, no breach yet
    clock.now += 2
    assert loop.tick().action is LendingAction.HOLD
    serving.p99 = 0.9  # the objective is broken: lend without waiting out the cool-down
    clock.now += 2
    assert loop.tick().action is LendingAction.LEND
    assert loop.train_devices == 2  # never below min_train_devices


def test_serving_re_splits_its_replicas_only_while_the_arbiter_holds(pool):
    loop, training, serving, clock, calls = pool
    serving.moves = ["decode at 1.50, prefill at 0.10 with one replica fewer: move one to decode"]
    serving.rate = 15.0
    loop.tick()  # a lend: the new replicas are split as they are added, no separate re-split
    assert serving.rebalances == 0
    clock.now += 60
    serving.rate = 10.0
    assert loop.tick().action is LendingAction.HOLD
    assert serving.rebalances == 1
    event = loop.events.recent()[-1]
    assert (event["kind"], event["infer_devices"]) == ("rebalance", 3) and "move one to decode" in event["reason"]


def test_a_disaggregated_application_needs_room_for_both_sides():
    from baige_ray.actors.serving_sides import DisaggregatedServingSide, serving_side
    from baige_ray.policies.disaggregation import SplitPolicy
    from baige_ray.serving.app import ServeHandleInfo

    info = ServeHandleInfo(url="http://127.0.0.1:8000", app_name="pd", deployment_name="DecodeServer",
                           prefill_deployment_name="PrefillServer", split=SplitPolicy())
    with pytest.raises(ValueError, match="ArbiterConfig.min_infer_devices=1.*prefill \\+ decode replicas \\(2\\)"):
        serving_side(info, None, ArbiterConfig(slo_p99_s=1.0, replica_capacity=1.0).min_infer_devices)
    side = serving_side(info, None, ArbiterConfig(slo_p99_s=1.0, replica_capacity=1.0, min_infer_devices=2).min_infer_devices)
    assert isinstance(side, DisaggregatedServingSide)


def test_only_the_devices_training_released_go_to_serving(pool):
    loop, training, serving, clock, calls = pool
    training.shortfall = 1  # asked for 5, training could only get down to 6
    serving.rate = 15.0
    loop.tick()
    assert (loop.train_devices, loop.infer_devices, serving.replicas) == (6, 2, 2)


def test_nothing_moves_while_training_is_not_running(pool):
    loop, training, serving, clock, calls = pool
    training.running = False
    serving.rate, serving.p99 = 50.0, 5.0
    decision = loop.tick()
    assert decision.action is LendingAction.HOLD and calls == []


def test_weights_refresh_on_schedule_while_holding(tmp_path):
    calls: list = []
    training, serving, clock = Training(calls, devices=6), Serving(calls, replicas=2), Clock()
    config = ArbiterConfig(slo_p99_s=0.5, replica_capacity=10.0, refresh_weights_s=30.0, policy=POLICY)
    loop = ArbiterLoop(training, serving, config, clock=clock, events=EventLog(None))
    serving.rate = 12.0
    loop.tick()
    assert calls == []
    clock.now += 31
    training.step = 90
    loop.tick()
    assert calls == [("latest_model_state", 90), ("reload", "ref@90")]


def test_capacity_follows_what_replicas_report(pool):
    loop, training, serving, clock, calls = pool
    serving.rate, serving.measured_capacity = 6.0, 5.0  # 30 requests in the window: enough to measure
    for _ in range(3):
        loop.observe()
    assert loop.replica_capacity == pytest.approx(5.0 + 5.0 * 0.7 ** 3)
    assert loop.tick().action is LendingAction.LEND  # 6 req/s is over 0.8 of one replica's ~5.2
    serving.rate = 2.0  # 10 requests: too few to trust, the estimate stays
    before = loop.replica_capacity
    loop.observe()
    assert loop.replica_capacity == before


def test_proxies_give_memory_back_once_a_backlog_drains(pool):
    loop, training, serving, clock, calls = pool
    serving.rate, serving.queue = 5.0, 40  # a backlog: the replicas cannot absorb it, so the arbiter lends
    assert loop.tick().action is LendingAction.LEND
    clock.now += 1
    assert loop.tick().action is LendingAction.HOLD  # cooling down, the backlog still there: nothing to trim yet
    assert ("return_idle_memory",) not in calls
    serving.queue = 1
    clock.now += 1
    assert loop.tick().action is LendingAction.HOLD
    assert calls[-1] == ("return_idle_memory",)
    assert read_events(loop.config.event_log)[-1]["returned_mib"] == 12.0
    clock.now += 60
    loop.tick()  # drained and idle since: nothing more to return
    assert calls.count(("return_idle_memory",)) == 1


def test_config_is_validated():
    with pytest.raises(ValueError, match="slo_p99_s"):
        ArbiterConfig(slo_p99_s=0, replica_capacity=1.0)
    with pytest.raises(ValueError, match="min_train_devices"):
        ArbiterConfig(slo_p99_s=1.0, replica_capacity=1.0, min_train_devices=0)


def _first_lend_rate(trend_window_s: float | None) -> tuple[float, ArbiterLoop]:
    """Raise the load by 0.2 requests/s each second; the rate at which the loop first lends.
    Each scale-up takes 20 s of the loop's clock (a replica starting)."""
    calls: list = []
    training, serving, clock = Training(calls), Serving(calls), Clock()
    scale = serving.scale

    def slow_scale(num_replicas: int) -> None:
        clock.now += 20.0
        scale(num_replicas)

    serving.scale = slow_scale
    config = ArbiterConfig(slo_p99_s=0.5, replica_capacity=10.0, min_train_devices=2, policy=POLICY,
                           lend_latency_s=10.0, load_window_s=4.0, trend_window_s=trend_window_s)
    loop = ArbiterLoop(training, serving, config, clock=clock, events=EventLog(None))
    for second in range(60):
        serving.rate = 3.0 + 0.2 * second
        if loop.tick().action is LendingAction.LEND:
            return serving.rate, loop
        clock.now += 1.0
    raise AssertionError("never lent")


def test_rising_load_is_lent_for_ahead_of_time_and_the_lend_latency_is_measured():
    reactive, _ = _first_lend_rate(trend_window_s=None)
    assert reactive > POLICY.lend_above * 10.0  # only once the load itself crosses the threshold
    ahead, loop = _first_lend_rate(trend_window_s=30.0)
    assert ahead < reactive - 2.0  # the forecast 10 s + a poll ahead crossed it first
    assert loop.lend_latency_s == pytest.approx((10.0 + 20.0) / 2)
    assert loop.events.recent()[-1]["forecast_rate"] > ahead


class HarvestingTraining(Training):
    """Training that can also run ranks beside replicas."""

    def __init__(self, calls: list, devices: int = 5):
        super().__init__(calls, devices)
        self.harvested = 0

    def num_harvested(self) -> int:
        return self.harvested

    def harvest(self, count: int, share: float, reason: str) -> int:
        self.calls.append(("harvest", count, share))
        self.harvested = count
        return count


def test_light_load_harvests_replica_devices_and_rising_load_gives_them_back_first(tmp_path):
    calls: list = []
    training, serving, clock = HarvestingTraining(calls), Serving(calls, replicas=3), Clock()
    policy = LendingPolicy(lend_above=0.8, target_utilization=0.6, reclaim_below=0.3, cooldown_s=10,
                           breach_cooldown_s=3, harvest_below=0.4)
    config = ArbiterConfig(slo_p99_s=0.5, replica_capacity=10.0, min_train_devices=2, policy=policy,
                           harvest_share=0.25, event_log=tmp_path / "events.jsonl")
    loop = ArbiterLoop(training, serving, config, clock=clock)
    serving.rate = 3.0  # 3 shared devices serve 15 req/s: 0.2
    assert loop.tick().action is LendingAction.HARVEST
    assert calls == [("harvest", 3, 0.25)] and loop.harvested == 3
    clock.now += 60
    serving.rate = 14.0  # 0.93 with all shared: give two back, not a lend
    assert loop.tick().action is LendingAction.UNHARVEST
    assert calls[-1] == ("harvest", 1, 0.25) and serving.replicas == 3 and training.devices == 5
    clock.now += 60
    serving.rate = 30.0
    loop.tick()  # one still shared: it goes back before any lend
    assert calls[-1] == ("harvest", 0, 0.25)
    clock.now += 60
    assert loop.tick().action is LendingAction.LEND
    events = read_events(config.event_log)
    assert [(e["kind"], e["harvested_devices"]) for e in events][:3] == [
        ("harvest", 3), ("unharvest", 1), ("unharvest", 0)]


def test_harvest_share_needs_a_policy_that_harvests():
    with pytest.raises(ValueError, match="harvest_below"):
        ArbiterConfig(slo_p99_s=1.0, replica_capacity=1.0, harvest_share=0.25)
    with pytest.raises(ValueError, match="harvest_share"):
        ArbiterConfig(slo_p99_s=1.0, replica_capacity=1.0, harvest_share=1.0,
                      policy=LendingPolicy(harvest_below=0.3, reclaim_below=0.2))


def test_status_answers_while_a_tick_is_moving_devices(tmp_path):
    """The soak's node loss asked the arbiter how many replicas it wanted while a lend was under way:
    the status waited on the lend for over 60 s and the call timed out."""
    import threading
    import time

    from baige_ray.actors.arbiter import ArbiterThread

    calls: list = []
    moving, release = threading.Event(), threading.Event()

    class SlowTraining(Training):
        def resize(self, num_devices: int, reason: str) -> int:
            moving.set()
            release.wait(30)
            return super().resize(num_devices, reason)

    training, serving = SlowTraining(calls), Serving(calls)
    serving.rate = 15.0
    config = ArbiterConfig(slo_p99_s=0.5, replica_capacity=10.0, min_train_devices=2, policy=POLICY,
                           poll_interval_s=0.05, event_log=tmp_path / "events.jsonl")
    runner = ArbiterThread(ArbiterLoop(training, serving, config))
    try:
        assert moving.wait(10)
        started = time.monotonic()
        status = runner.status()
        assert time.monotonic() - started < 1.0
        assert (status["train_devices"], status["infer_devices"], status["errors"]) == (7, 1, [])
    finally:
        release.set()
        final = runner.stop()
    assert (final["train_devices"], final["infer_devices"]) == (5, 3)
