"""A reader started on a node reads, and removes, the shelf a worker of the job left there."""

from __future__ import annotations

import ray
import torch

from baige_ray.elastic.shelf import SnapshotShelf, shelf_directory
from baige_ray.elastic.shelf_readers import ShelfReaders
from baige_ray.parallel.boxes import Box
from baige_ray.parallel.shards import ShardedPart


def test_a_reader_on_the_shelfs_node_reads_it_and_removes_it(local_ray):
    name = "baige-worker:shelf-readers-test:dead0001"
    part = ShardedPart({"model": {"w": torch.arange(6.0).view(2, 3)}, "optimizer": {}},
                       {"w": Box((4, 3), (0, 0), (2, 3))})
    shelf = SnapshotShelf(shelf_directory(name))
    shelf.begin()
    shelf.commit(7, part)
    readers = ShelfReaders()
    try:
        reader = readers.on_node(ray.get_runtime_context().get_node_id())
        assert readers.on_node(ray.get_runtime_context().get_node_id()) is reader  # one per node
        assert ray.get(reader.shelf_steps_of.remote(name), timeout=60) == [7]
        read = ray.get(reader.read_shelf_of.remote(name, 7), timeout=60)
        assert torch.equal(read.state["model"]["w"], part.state["model"]["w"])
        ray.get(reader.discard_shelf_of.remote(name), timeout=60)
        assert not shelf_directory(name).exists()
        assert readers.on_node("ff" * 28) is None  # a node that is gone: its shelves went with it
    finally:
        readers.stop()
        shelf.remove()
