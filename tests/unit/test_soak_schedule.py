"""The soak's seeded fault schedule (bench/soak_schedule.py)."""

import pytest

from baige_ray.bench.soak_schedule import FAULT_KINDS, fault_schedule, spiky_rates


def test_a_three_minute_soak_meets_every_kind_and_the_schedule_repeats_with_its_seed():
    schedule = fault_schedule(180.0, seed=3)
    assert {fault.kind for fault in schedule} == set(FAULT_KINDS)
    assert schedule == fault_schedule(180.0, seed=3) and schedule != fault_schedule(180.0, seed=4)
    times = [fault.at_s for fault in schedule]
    assert times[0] == 20.0 and times[-1] <= 160.0
    scale = 140.0 / ((len(FAULT_KINDS) - 1) * 40.0)  # one round of every kind fits between 20 s and 160 s
    assert all(25.0 * scale <= b - a <= 40.0 * scale for a, b in zip(times, times[1:]))


def test_a_long_soak_keeps_the_full_gaps():
    times = [fault.at_s for fault in fault_schedule(1800.0, seed=1)]
    assert all(25.0 <= b - a <= 40.0 for a, b in zip(times, times[1:]))


def test_kinds_come_in_rounds_so_none_repeats_before_all_have_come():
    kinds = [fault.kind for fault in fault_schedule(1800.0, seed=0)]
    rounds = [kinds[i:i + len(FAULT_KINDS)] for i in range(0, len(kinds) - len(FAULT_KINDS) + 1, len(FAULT_KINDS))]
    assert rounds and all(sorted(r) == sorted(FAULT_KINDS) for r in rounds)


def test_an_impossible_schedule_is_refused_naming_its_values():
    with pytest.raises(ValueError, match="gap_s=\\(5.0, 1.0\\)"):
        fault_schedule(60.0, seed=0, gap_s=(5.0, 1.0))


def test_the_load_spikes_once_in_every_four_segments_never_first_and_repeats_with_its_seed():
    rates = spiky_rates(180.0, base_rate=2.0, spike_rate=9.0, seed=5)
    assert len(rates) == 9 and rates[0] == 2.0 and set(rates) == {2.0, 9.0}
    spikes = [i for i, rate in enumerate(rates) if rate == 9.0]
    assert all(b - a == 4 for a, b in zip(spikes, spikes[1:])) and len(spikes) >= 2
    assert rates == spiky_rates(180.0, base_rate=2.0, spike_rate=9.0, seed=5)
    with pytest.raises(ValueError, match="spike_rate=1.0"):
        spiky_rates(180.0, base_rate=2.0, spike_rate=1.0, seed=0)
