"""The control thread's requests reach the controller's loop as typed commands with their own futures."""

import threading

import pytest

from baige_ray.elastic.commands import CommandQueue, Harvest, JobOver, Resize, Stop


def test_commands_are_taken_in_order_and_each_caller_gets_its_own_answer():
    queue = CommandQueue()
    first, second = queue.submit(Resize(2, "lend")), queue.submit(Harvest(1))
    assert queue
    taken = queue.take()
    assert taken.command == Resize(2, "lend")
    taken.answer.set_result(2)
    assert first.result(timeout=0) == 2 and not second.done()
    assert queue.take().command == Harvest(1) and queue.take() is None and not queue


def test_a_caller_on_another_thread_waits_until_the_loop_answers():
    queue = CommandQueue()
    answers = []
    caller = threading.Thread(target=lambda: answers.append(queue.submit(Stop()).result(timeout=5)))
    caller.start()
    while (pending := queue.take()) is None:
        pass
    pending.answer.set_result("stopped")
    caller.join(timeout=5)
    assert answers == ["stopped"]


def test_closing_hands_back_what_was_never_taken_and_refuses_later_commands():
    queue = CommandQueue()
    queue.submit(Stop())
    left = queue.close("finished")
    assert [p.command for p in left] == [Stop()] and not queue
    with pytest.raises(JobOver, match="finished"):
        queue.submit(Resize(4)).result(timeout=0)
