"""The recovery benchmark's arithmetic on recorded steps (no Ray)."""

from __future__ import annotations

import pytest

from baige_ray.bench.recovery import recovery_figures


def records(steps, attempt, start, step_s=0.1):
    return [{"step": s, "start": start + i * step_s, "end": start + (i + 1) * step_s, "attempt": attempt}
            for i, s in enumerate(steps)]


def test_recovery_ends_with_the_restarted_attempts_first_step():
    first = records(range(0, 25), attempt=1, start=0.0)  # step 24 ends at 2.5 s
    crashed_at = 2.49  # the crashed rank began step 25 just before rank 0 logged step 24
    second = records(range(20, 40), attempt=2, start=22.0)
    figures = recovery_figures(first + second, crashed_at, crash_step=25)
    assert figures["recovery_s"] == pytest.approx(22.1 - 2.49)
    assert figures["lost_steps"] == 6  # steps 20..25 ran twice (25 only began the first time)
    assert figures["per_step_s"] == pytest.approx(0.1)


def test_a_run_that_never_came_back_is_an_error():
    with pytest.raises(RuntimeError, match="no step completed after the crash"):
        recovery_figures(records(range(25), attempt=1, start=0.0), 2.5, crash_step=25)
