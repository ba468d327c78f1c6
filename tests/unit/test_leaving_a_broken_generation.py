"""Leaving a generation that broke does not wait out gloo's timeout: a collective a live peer left
(an aborted step, a regroup a member died in) and a store whose host died both end at once."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from baige_ray.parallel.distributed import STORE_CONNECT_TIMEOUT_S, GroupMembership, ProcessGroupMember, StoreAddress

TIMEOUT_S = 60.0  # what a stuck collective would cost if leaving waited for it


def member(address: StoreAddress, rank: int, results) -> None:
    group = ProcessGroupMember("gloo", timeout_s=TIMEOUT_S)
    group.join(GroupMembership(address, rank=rank, world_size=3, generation=0))
    dist.barrier()
    if rank == 2:  # a live peer that never joins the collective the others started
        results.put((rank, "idle", 0.0))
        time.sleep(TIMEOUT_S)
        return
    dist.all_reduce(torch.ones(4), async_op=True)
    time.sleep(0.2)
    started = time.monotonic()
    group.leave()
    left_s = time.monotonic() - started
    group.join(GroupMembership(address, rank=rank, world_size=2, generation=1))  # the next generation works
    total = torch.ones(1)
    dist.all_reduce(total)
    results.put((rank, float(total), left_s))


def test_leaving_with_a_collective_in_flight_and_joining_again_is_immediate():
    host = ProcessGroupMember("gloo", timeout_s=TIMEOUT_S)
    address = host.host_store("127.0.0.1")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=member, args=(address, rank, results), daemon=True) for rank in range(3)]
    for process in processes:
        process.start()
    try:
        answers = sorted(results.get(timeout=50) for _ in processes)
    finally:
        for process in processes:
            process.kill()
    assert answers[2][:2] == (2, "idle")
    for rank, total, left_s in answers[:2]:
        assert total == 2.0, f"rank {rank} summed {total} in the next generation"
        assert left_s < 5.0, f"rank {rank} took {left_s:.1f}s to leave: it waited for the stuck collective"


def host_then_die(addresses) -> None:
    addresses.put(ProcessGroupMember("gloo", timeout_s=TIMEOUT_S).host_store("127.0.0.1"))
    time.sleep(TIMEOUT_S)


def test_joining_a_generation_whose_store_host_died_fails_at_once():
    context = multiprocessing.get_context("spawn")
    addresses = context.Queue()
    host = context.Process(target=host_then_die, args=(addresses,), daemon=True)
    host.start()
    address = addresses.get(timeout=30)
    host.kill()
    host.join()
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        ProcessGroupMember("gloo", timeout_s=TIMEOUT_S).join(GroupMembership(address, rank=1, world_size=2, generation=0))
    assert time.monotonic() - started < STORE_CONNECT_TIMEOUT_S
