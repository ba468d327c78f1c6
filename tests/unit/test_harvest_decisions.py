"""What a harvest regroups with, decided without Ray."""

import pytest

from baige_ray.api.device import DeviceInfo
from baige_ray.elastic.commands import Harvest
from baige_ray.elastic.harvest import check_harvest, harvest_members, harvest_regroup, whole_members
from baige_ray.elastic.workers import Worker


def worker(name: str, node: str, index: int, share: float = 1.0) -> Worker:
    info = DeviceInfo(node_id=node, node_ip="127.0.0.1", hostname="h", pid=1, device_kind="cuda",
                      device_index=index, device_name="sim", memory_bytes=0, ray_resource="GPU", simulated=True)
    return Worker(actor=None, name=name, info=info, share=share)


WHOLE = [worker("w0", "a", 0), worker("w1", "a", 1)]


def test_new_harvest_ranks_join_in_locality_order_beside_the_whole_workers():
    incoming = [worker("h1", "b", 1, 0.5), worker("h0", "b", 0, 0.5)]
    members, released = harvest_regroup(WHOLE, Harvest(wanted=2, incoming=tuple(incoming)))
    assert [w.name for w in members] == ["w0", "w1", "h0", "h1"] and released == []
    assert [w.name for w in whole_members(members)] == ["w0", "w1"]
    assert [w.name for w in harvest_members(members)] == ["h0", "h1"]


def test_giving_devices_back_releases_the_newest_harvest_ranks_and_surplus_incoming_ones():
    held = WHOLE + [worker("h0", "b", 0, 0.5), worker("h1", "b", 1, 0.5)]
    members, released = harvest_regroup(held, Harvest(wanted=1))
    assert [w.name for w in members] == ["w0", "w1", "h0"] and [w.name for w in released] == ["h1"]
    extra = [worker("h2", "c", 0, 0.5)]
    members, released = harvest_regroup(held, Harvest(wanted=2, incoming=tuple(extra)))
    assert [w.name for w in members] == ["w0", "w1", "h0", "h1"] and [w.name for w in released] == ["h2"]


def test_a_harvest_the_job_cannot_run_names_the_field():
    with pytest.raises(ValueError, match="share=1.5"):
        check_harvest(1, 1.5, num_whole=2, sizes=(2, 3, 4), planned=False)
    with pytest.raises(ValueError, match="count=3 is invalid: 2 whole workers plus 3 would be 5"):
        check_harvest(3, 0.5, num_whole=2, sizes=(2, 3, 4), planned=False)
    with pytest.raises(ValueError, match="fixed layout"):
        check_harvest(1, 0.5, num_whole=2, sizes=(2, 3), planned=True)
    check_harvest(2, 0.5, num_whole=2, sizes=(2, 3, 4), planned=False)
