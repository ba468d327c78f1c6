"""Who reads a dead rank's shelf: a live member of the group on its node, or a spare there."""

from __future__ import annotations

from baige_ray.api.device import DeviceInfo
from baige_ray.elastic.state_sources import newest_on_shelves
from baige_ray.elastic.workers import Worker
from tests.fake_pool import Answered


class ShelfActor:
    """What one node's shared memory holds, as any actor on that node reads it."""

    def __init__(self, shelves: dict[str, list[int]]):
        self.shelf_steps_of = _Remote(lambda name: Answered(shelves[name]))


class _Remote:
    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args):
        return self.answer(*args)


def on_node(name: str, node: str, actor) -> Worker:
    info = DeviceInfo(node_id=node, node_ip=node, hostname=node, pid=1, device_kind="gpu", device_index=0,
                      device_name="fake", memory_bytes=0, ray_resource="GPU", simulated=True)
    return Worker(actor=actor, name=name, info=info)


def test_a_spare_on_the_node_of_a_rank_with_no_surviving_peer_there_reads_its_shelf():
    node_a = {"w0": [5, 4]}
    node_b = {"w1": [4, 3]}  # w1 died copying step 5: its newest whole snapshot is step 4's
    survivor, dead = on_node("w0", "a", ShelfActor(node_a)), on_node("w1", "b", None)
    members = [(0, survivor), (1, dead)]
    assert newest_on_shelves(members, [survivor]) is None  # nobody left on node b
    spare = on_node("spare", "b", ShelfActor(node_b))
    step, parts = newest_on_shelves(members, [survivor, spare])
    assert step == 4
    assert [(part.worker_name, part.node_id, part.reader) for part in parts] == [
        ("w0", "a", survivor.actor), ("w1", "b", spare.actor)]
