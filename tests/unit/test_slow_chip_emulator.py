import pytest
import torch
from torch import nn

from baige_ray.engines.base import SlowChipEmulator


class FakeClock:
    """A clock that only moves when work or a sleep moves it, so emulated time is exact."""

    def __init__(self, oversleep_s: float = 0.0):
        self.now = 0.0
        self.oversleep_s = oversleep_s
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + self.oversleep_s


class TimedWork(torch.autograd.Function):
    """Identity whose forward and backward each take a set amount of fake time."""

    @staticmethod
    def forward(ctx, x, clock, forward_s, backward_s):
        clock.now += forward_s
        ctx.clock, ctx.backward_s = clock, backward_s
        return x * 2.0

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.now += ctx.backward_s
        return grad * 2.0, None, None, None


class TimedStage(nn.Module):
    """Token ids in (no gradient flows to the input, like a first pipeline stage), timed work inside."""

    def __init__(self, clock: FakeClock, forward_s: float, backward_s: float):
        super().__init__()
        self.embedding = nn.Embedding(8, 4)
        self.clock, self.forward_s, self.backward_s = clock, forward_s, backward_s

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return TimedWork.apply(self.embedding(ids), self.clock, self.forward_s, self.backward_s)


def run_step(speed: float, forward_s: float = 1.0, backward_s: float = 2.5):
    clock = FakeClock()
    torch.manual_seed(0)
    stage = TimedStage(clock, forward_s, backward_s)
    emulator = SlowChipEmulator(stage, speed, clock=clock, work_clock=clock, sleep=clock.sleep)
    stage(torch.tensor([[1, 2, 3]])).square().sum().backward()
    return clock, emulator, stage


@pytest.mark.parametrize("speed", [0.5, 0.25, 0.8])
def test_forward_and_backward_each_take_one_over_speed_as_long(speed):
    clock, emulator, _ = run_step(speed, forward_s=1.0, backward_s=2.5)
    slowdown = 1.0 / speed - 1.0
    assert clock.sleeps == pytest.approx([1.0 * slowdown, 2.5 * slowdown])
    assert clock.now == pytest.approx((1.0 + 2.5) / speed)
    assert emulator.forward_s == pytest.approx(1.0 / speed)


def test_backward_to_forward_ratio_does_not_change_the_slowdown():
    for backward_s in (1.5, 2.0, 3.2):
        clock, _, _ = run_step(0.5, forward_s=1.0, backward_s=backward_s)
        assert clock.now == pytest.approx(2 * (1.0 + backward_s))


def test_full_speed_never_sleeps_and_a_later_slowdown_applies_from_the_next_forward():
    clock, emulator, stage = run_step(1.0)
    assert clock.sleeps == [] and emulator.forward_s == pytest.approx(1.0)
    emulator.set_speed(0.5)
    started = clock.now
    stage(torch.tensor([[4]])).sum().backward()
    assert clock.now - started == pytest.approx(2 * 3.5)


def test_emulation_leaves_outputs_and_gradients_unchanged():
    _, _, slow = run_step(0.5)
    _, _, fast = run_step(1.0)
    assert torch.equal(slow.embedding.weight.grad, fast.embedding.weight.grad)
    no_grad_clock = FakeClock()
    stage = TimedStage(no_grad_clock, 1.0, 1.0)
    SlowChipEmulator(stage, 0.5, clock=no_grad_clock, work_clock=no_grad_clock, sleep=no_grad_clock.sleep)
    with torch.no_grad():  # no autograd graph: the forward is still slowed, nothing waits for a backward
        stage(torch.tensor([[1]]))
    assert no_grad_clock.sleeps == pytest.approx([1.0])


def test_oversleeping_is_taken_off_the_next_sleep_so_a_step_stays_exact():
    clock = FakeClock(oversleep_s=0.1)
    stage = TimedStage(clock, forward_s=1.0, backward_s=2.0)
    SlowChipEmulator(stage, 0.5, clock=clock, work_clock=clock, sleep=clock.sleep)
    for _ in range(10):
        stage(torch.tensor([[1]])).sum().backward()
    assert clock.sleeps[:3] == pytest.approx([1.0, 1.9, 0.9])
    # 10 micro-batches of 3 s real work at half speed: 60 s, off by one sleep's overshoot at most.
    assert 60.0 <= clock.now <= 60.1 + 1e-9


def test_time_other_processes_held_the_core_is_not_stretched():
    wall, cpu = FakeClock(), FakeClock()

    class PreemptedWork(nn.Module):
        """1 s of work that takes 3 s of wall time on a busy machine."""

        def forward(self, x):
            wall.now += 3.0
            cpu.now += 1.0
            return x * 2.0

    module = PreemptedWork()
    emulator = SlowChipEmulator(module, 0.5, clock=wall, work_clock=cpu, sleep=wall.sleep)
    module(torch.ones(2))
    assert wall.sleeps == pytest.approx([1.0])
    assert emulator.forward_s == pytest.approx(4.0)  # the chip's own pace, emulation included


@pytest.mark.parametrize("speed", [1.0, 0.5])
def test_compute_time_is_forward_and_backward_without_the_wait_for_peers_queued_after_it(speed):
    """A DDP-like wait for the peers' gradients, queued once the parameters' gradients are ready, is not the
    chip's time: a straggler's peers wait there, and must not look slow for it."""
    clock = FakeClock()
    stage = TimedStage(clock, forward_s=1.0, backward_s=2.5)
    emulator = SlowChipEmulator(stage, speed, clock=clock, work_clock=clock, sleep=clock.sleep)

    def wait_for_peers(_grad):
        torch.autograd.Variable._execution_engine.queue_callback(lambda: setattr(clock, "now", clock.now + 7.0))

    stage.embedding.weight.register_hook(wait_for_peers)
    stage(torch.tensor([[1, 2, 3]])).square().sum().backward()
    assert emulator.forward_s == pytest.approx(1.0 / speed)
    assert emulator.backward_s == pytest.approx(2.5 / speed)
    assert emulator.compute_s == pytest.approx(3.5 / speed) and clock.now == pytest.approx(3.5 / speed + 7.0)
    emulator.reset()
    assert emulator.compute_s == 0.0
