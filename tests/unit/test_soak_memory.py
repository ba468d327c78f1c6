"""The soak's memory growth (bench/soak_memory.py): a leak shows, warm-ups do not."""

import pytest

from baige_ray.bench.soak_memory import memory_growth, timeline

MB = 1 << 20


def samples_every_10s(series: dict[int, tuple[str, dict[int, int]]], members: dict[int, set[int]], end_s: int):
    """Samples at 0, 10, ... end_s from {pid: (class, {second: rss})} (a pid absent before its first second)."""
    out = []
    for t in range(0, end_s + 1, 10):
        rss = {pid: (name, max((v for s, v in points.items() if s <= t), default=None))
               for pid, (name, points) in series.items() if min(points) <= t}
        out.append((float(t), rss, members.get(t, set())))
    return out


def test_a_leak_shows_and_a_restarted_controller_counts_from_when_it_settled():
    series = {
        1: ("ServingRegistry", {0: 100 * MB, 200: 120 * MB}),  # a leak: +20%
        2: ("ElasticController", {50: 50 * MB, 100: 100 * MB}),  # restarted at 50 s, warm by 100 s
        3: ("ElasticWorkerActor", {0: 100 * MB, 80: 200 * MB}),  # a spare that joined at 80 s
    }
    members = {t: ({3} if t >= 80 else set()) for t in range(0, 301, 10)}
    growth = memory_growth(samples_every_10s(series, members, 300), from_s=60.0)["growth"]
    assert growth["ServingRegistry:1"] == pytest.approx(0.2)
    assert growth["ElasticController:2"] == 0.0  # counted from 110 s: alive 60 s by then
    assert growth["ElasticWorkerActor:3"] == 0.0  # counted from 90 s: a member one sample since


def test_the_timeline_samples_each_process_about_every_minute_with_gaps_where_it_was_not_alive():
    series = {1: ("ProxyActor", {0: 100 * MB, 120: 110 * MB}), 2: ("ElasticController", {100: 50 * MB})}
    samples = samples_every_10s(series, {}, 150)
    assert timeline(samples, [1, 2]) == {"ProxyActor:1": [100.0, 100.0, 110.0, 110.0],
                                         "ElasticController:2": [None, None, 50.0, 50.0]}
