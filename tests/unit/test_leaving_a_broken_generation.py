"""Leaving a generation that broke does not wait out gloo's timeout: a collective a live peer left
(an aborted step, a regroup a member died in) and a store whose host died both end at once; a member
that died after arriving holds the others' connect only for the connect timeout."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from baige_ray.parallel.distributed import STORE_CONNECT_TIMEOUT_S, GroupMembership, ProcessGroupMember, StoreAddress
from tests.helpers import rank_context

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


def run_members(target, address: StoreAddress, count: int) -> list:
    """Run `target(address, rank, results)` in `count` new processes; what each put in `results`, sorted."""
    context = rank_context()
    results = context.Queue()
    processes = [context.Process(target=target, args=(address, rank, results), daemon=True) for rank in range(count)]
    for process in processes:
        process.start()
    try:
        return sorted(results.get(timeout=50) for _ in processes)
    finally:
        for process in processes:
            process.kill()


def test_leaving_with_a_collective_in_flight_and_joining_again_is_immediate():
    host = ProcessGroupMember("gloo", timeout_s=TIMEOUT_S)
    address = host.host_store("127.0.0.1")
    answers = run_members(member, address, 3)
    assert answers[2][:2] == (2, "idle")
    for rank, total, left_s in answers[:2]:
        assert total == 2.0, f"rank {rank} summed {total} in the next generation"
        assert left_s < 5.0, f"rank {rank} took {left_s:.1f}s to leave: it waited for the stuck collective"


def host_then_die(addresses) -> None:
    addresses.put(ProcessGroupMember("gloo", timeout_s=TIMEOUT_S).host_store("127.0.0.1"))
    time.sleep(TIMEOUT_S)


def test_joining_a_generation_whose_store_host_died_fails_at_once():
    context = rank_context()
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


CONNECT_TIMEOUT_S = 1.0


def member_after_a_death(address: StoreAddress, rank: int, results) -> None:
    group = ProcessGroupMember("gloo", timeout_s=TIMEOUT_S, connect_timeout_s=CONNECT_TIMEOUT_S)
    started = time.monotonic()
    try:
        group.join(GroupMembership(address, rank=rank, world_size=3, generation=0))
        outcome = "joined"
    except Exception as error:  # gloo's connect timing out: a DistStoreError or a RuntimeError
        outcome = type(error).__name__
    failed_s = time.monotonic() - started
    group.join(GroupMembership(address, rank=rank, world_size=2, generation=1))
    if rank == 1:  # later than the connect timeout: the collectives wait under the group's full timeout
        time.sleep(3 * CONNECT_TIMEOUT_S)
    total = torch.ones(1)
    dist.all_reduce(total)
    results.put((rank, outcome, failed_s, float(total)))


def test_a_member_dying_after_it_arrived_holds_the_others_only_for_the_connect_timeout():
    host = ProcessGroupMember("gloo", timeout_s=TIMEOUT_S)
    address = host.host_store("127.0.0.1")
    # Rank 2 arrives at generation 0's rendezvous and is gone before gloo connects.
    dist.PrefixStore("baige/generation-0", host._store_for(address)).add("arrived", 1)
    for rank, outcome, failed_s, total in run_members(member_after_a_death, address, 2):
        assert outcome != "joined", f"rank {rank} joined a generation whose third member never connected"
        assert failed_s < 10 * CONNECT_TIMEOUT_S, f"rank {rank} waited {failed_s:.1f}s for the dead member"
        assert total == 2.0, f"rank {rank} summed {total} in the next generation"


def member_building_meshes_after_a_death(address: StoreAddress, rank: int, results) -> None:
    from baige_ray.parallel.subgroups import collective_timeout, device_mesh, subgroup

    group = ProcessGroupMember("gloo", timeout_s=TIMEOUT_S)
    group.join(GroupMembership(address, rank=rank, world_size=3, generation=0))
    dist.barrier()
    if rank == 2:  # gone after the generation formed, before the engine built its meshes
        import os

        results.put((rank, "left", set(), 0.0))
        time.sleep(0.2)  # the queue's feeder thread hands the answer over
        os._exit(0)
    time.sleep(0.5)
    outcomes = []
    for build in (lambda: device_mesh("cpu", (1, 3), ("pp", "dp"), connect_timeout_s=CONNECT_TIMEOUT_S),
                  lambda: subgroup([0, 1, 2], connect_timeout_s=CONNECT_TIMEOUT_S)):
        started = time.monotonic()
        try:
            build()
            outcomes.append(("built", time.monotonic() - started))
        except Exception as error:  # gloo's connect or the store barrier timing out
            outcomes.append((type(error).__name__, time.monotonic() - started))
    group.join(GroupMembership(address, rank=rank, world_size=2, generation=1))
    mesh = device_mesh("cpu", (1, 2), ("pp", "dp"), connect_timeout_s=CONNECT_TIMEOUT_S)
    pair = subgroup([0, 1], connect_timeout_s=CONNECT_TIMEOUT_S)
    timeouts = {collective_timeout(g).total_seconds() for g in (mesh.get_group("dp"), mesh.get_group("pp"), pair)}
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh.get_group("dp"))
    results.put((rank, outcomes, timeouts, float(total)))


def test_a_member_dying_before_the_meshes_are_built_holds_the_others_only_for_the_connect_timeout():
    host = ProcessGroupMember("gloo", timeout_s=TIMEOUT_S)
    address = host.host_store("127.0.0.1")
    *survivors, gone = run_members(member_building_meshes_after_a_death, address, 3)
    assert gone[:2] == (2, "left")
    for rank, outcomes, timeouts, total in survivors:
        for outcome, seconds in outcomes:
            assert outcome != "built", f"rank {rank} built a group with a dead member"
            assert seconds < 10 * CONNECT_TIMEOUT_S, f"rank {rank} waited {seconds:.1f}s for the dead member"
        assert timeouts == {TIMEOUT_S}, f"rank {rank}'s subgroups wait {timeouts} s on a collective"
        assert total == 2.0
