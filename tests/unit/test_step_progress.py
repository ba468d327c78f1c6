"""StepProgress (elastic/step_progress.py): a waiter hears of the step it waits for when it is set, not
at its timeout; an ended job or the timeout end the wait too."""

import threading
import time

from baige_ray.elastic.step_progress import StepProgress


def test_a_waiter_wakes_when_the_step_it_waits_for_is_set():
    progress, woken = StepProgress(), []
    waiter = threading.Thread(target=lambda: woken.append((progress.wait_for(3, 10.0, ended=lambda: False),
                                                           time.monotonic())))
    waiter.start()
    progress.set(2)
    time.sleep(0.05)
    assert not woken  # step 2 is not enough
    set_at = time.monotonic()
    progress.set(3)
    waiter.join(5.0)
    (next_step, at), = woken
    assert next_step == 3 and at - set_at < 0.2


def test_an_ended_job_or_the_timeout_ends_the_wait():
    progress, over = StepProgress(), threading.Event()
    threading.Timer(0.1, over.set).start()
    started = time.monotonic()
    assert progress.wait_for(5, 10.0, ended=over.is_set, recheck_s=0.02) == 0
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    assert progress.wait_for(5, 0.1, ended=lambda: False) == 0
    assert 0.09 < time.monotonic() - started < 1.0
