"""Devices a resize released are held for whoever the job shrank for, until the hold ends or a grow."""

from baige_ray.elastic.device_holds import ReleasedDevices


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_released_devices_are_held_until_their_hold_ends_each_on_its_own_clock():
    clock = Clock()
    released = ReleasedDevices(hold_s=60.0, clock=clock)
    released.hold(2)
    clock.now += 30
    released.hold(1)
    assert released.held() == 3
    clock.now += 30  # the first hold's 60 s are over
    assert released.held() == 1
    clock.now += 30
    assert released.held() == 0


def test_a_grow_ends_every_hold_and_a_zero_hold_holds_nothing():
    released = ReleasedDevices(hold_s=60.0, clock=Clock())
    released.hold(2)
    released.end()
    assert released.held() == 0
    unheld = ReleasedDevices(hold_s=0.0, clock=Clock())
    unheld.hold(3)
    assert unheld.held() == 0
