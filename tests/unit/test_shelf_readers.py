"""Who reads a dead rank's shelf: a member staying on its node, a spare there, or a reader started there."""

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


def test_a_rank_alone_on_its_node_is_read_by_a_reader_started_there():
    node_a, node_b = {"w0": [5, 4]}, {"w1": [5, 4]}
    survivor, dead = on_node("w0", "a", ShelfActor(node_a)), on_node("w1", "b", None)
    started = []

    def reader_on(node_id: str):
        started.append(node_id)
        return ShelfActor(node_b)

    step, parts = newest_on_shelves([(0, survivor), (1, dead)], [survivor], reader_on)
    assert step == 5 and started == ["b"]
    assert parts[1].reader is not survivor.actor and parts[1].node_id == "b"
    # Its node gone, its shelf went with it: the restore must look elsewhere (replicas, checkpoints).
    assert newest_on_shelves([(0, survivor), (1, dead)], [survivor], lambda node_id: None) is None


def test_a_rank_being_stopped_does_not_read_its_own_shelf_for_a_restore_that_comes_after_it():
    """A wedged or evicted rank still answers, but it is stopped before the new group reads the shelves:
    with a survivor on its node that one reads it, else a reader started there (it read it before,
    and the restore then failed on a dead reader)."""
    shelves = {"w0": [5, 4], "w1": [5, 4]}
    survivor, leaving = on_node("w0", "a", ShelfActor(shelves)), on_node("w1", "a", ShelfActor(shelves))
    step, parts = newest_on_shelves([(0, survivor), (1, leaving)], [survivor])
    assert step == 5 and [part.reader for part in parts] == [survivor.actor, survivor.actor]
    alone = on_node("w1", "b", ShelfActor({"w1": [5, 4]}))
    reader = ShelfActor({"w1": [5, 4]})
    _, parts = newest_on_shelves([(0, survivor), (1, alone)], [survivor], lambda node_id: reader)
    assert parts[1].reader is reader
