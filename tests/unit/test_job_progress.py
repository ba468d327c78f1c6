"""The progress line of a launch() job, fed by the controller's status."""

from __future__ import annotations

import io
import time

from baige_ray.runtime.progress import JobProgress


def status(step: int, state: str = "running", loss: float | None = 5.5) -> dict:
    return {"step": step, "num_steps": 10, "state": state, "num_workers": 4, "steps_per_s": 2.0, "loss": loss,
            "tokens_per_s": 12345.0, "mfu": 0.234, "persisted_step": 4 if step >= 5 else None}


def test_a_job_progress_line_follows_the_status_shows_recovery_and_ends_with_the_job():
    statuses = iter([status(0, loss=None), status(3), status(5, "recovering"), status(10, "finished")])
    out = io.StringIO()
    progress = JobProgress(lambda: next(statuses), 10, interval_s=0.01, file=out).start()
    deadline = time.monotonic() + 5
    while "10/10" not in out.getvalue():
        assert time.monotonic() < deadline, out.getvalue()
        time.sleep(0.01)
    progress.close()
    text = out.getvalue()
    assert "3/10" in text and "state=recovering" in text and "loss=5.500" in text and "workers=4" in text
    assert "tok_s=12,345" in text and "mfu=23.4%" in text and "ckpt=4" in text


def test_the_line_stops_quietly_when_the_job_is_gone():
    def gone() -> dict:
        raise RuntimeError("the controller died")

    out = io.StringIO()
    progress = JobProgress(gone, 10, interval_s=0.01, file=out).start()
    time.sleep(0.1)
    progress.close()
    assert "0/10" in out.getvalue()


def test_a_stage_progress_line_draws_only_once_work_takes_long():
    from baige_ray.runtime.progress import StageProgress

    quick, slow = io.StringIO(), io.StringIO()
    with StageProgress("plan", delay_s=10.0, file=quick) as progress:
        progress("layouts", 5, 10)
    with StageProgress("plan", delay_s=0.0, file=slow) as progress:
        progress("the cluster's resource graph", 0, 1)
        progress("layouts", 3, 10)
        progress("layouts", 7, 10)
    assert quick.getvalue() == ""
    assert "plan: layouts" in slow.getvalue() and "/10 " in slow.getvalue()


def test_a_long_single_call_still_shows_its_line_and_elapsed_time():
    from baige_ray.runtime.progress import StageProgress

    out = io.StringIO()
    with StageProgress("final checkpoint", delay_s=0.2, file=out, unit="B", unit_scale=True) as progress:
        progress("writing /runs/x/final", 0, 2_000_000)
        time.sleep(1.0)  # the write, reporting nothing
        assert "final checkpoint: writing /runs/x/final" in out.getvalue()
        progress("writing /runs/x/final", 2_000_000, 2_000_000)
