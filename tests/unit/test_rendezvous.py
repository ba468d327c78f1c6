"""The arrival wait before init_process_group: all arrive, the controller abandons, or it times out."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from baige_ray.parallel.distributed import RendezvousAbandoned, await_arrivals


def test_the_wait_ends_when_the_last_member_arrives():
    store = dist.HashStore()
    late = threading.Timer(0.2, lambda: store.add("arrived", 1))
    late.start()
    started = time.monotonic()
    await_arrivals(store, world_size=2, abandoned=lambda: False, timeout_s=10)
    assert 0.15 < time.monotonic() - started < 5
    late.join()


def test_an_abandoned_generation_releases_the_waiting_members_at_once():
    store = dist.HashStore()
    abandon = threading.Event()
    threading.Timer(0.1, abandon.set).start()
    started = time.monotonic()
    with pytest.raises(RendezvousAbandoned, match="1 of 3 members arrived"):
        await_arrivals(store, world_size=3, abandoned=abandon.is_set, timeout_s=60)
    assert time.monotonic() - started < 5


def test_a_member_that_never_arrives_times_the_wait_out():
    with pytest.raises(TimeoutError, match="1 of 2 members"):
        await_arrivals(dist.HashStore(), world_size=2, abandoned=lambda: False, timeout_s=0.2)
