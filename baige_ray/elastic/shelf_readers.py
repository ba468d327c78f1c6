"""Readers for the shelves on nodes where the job has no live worker left.

A sharded snapshot lives on its rank's shelf, in its node's shared memory (shelf.py), and outlives the
rank's process. A worker on another node reads it through a live actor on the shelf's node: normally a
member or spare of the job. When none is left there (the dead rank was alone on its node, or the only
workers there are being stopped), `ShelfReaders` starts a `ShelfReader` on that node, so the restore
still comes from memory instead of an older persisted checkpoint. The readers are owned by the
controller's process (they end with it) and are stopped once the restored state is in place.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from baige_ray.elastic.shelf import ShelfReader


class ShelfReaders:
    def __init__(self):
        self._readers: dict[str, Any] = {}  # node id -> the ShelfReader actor there

    def on_node(self, node_id: str) -> Any | None:
        """A reader on `node_id` (started now, or the one started before); None when the node is gone
        (its shelves went with it)."""
        if node_id in self._readers:
            return self._readers[node_id]
        if node_id not in alive_node_ids():
            return None
        reader = ray.remote(ShelfReader).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        self._readers[node_id] = reader
        return reader

    def stop(self) -> None:
        for reader in self._readers.values():
            try:
                ray.kill(reader, no_restart=True)
            except Exception:  # already gone with its node
                pass
        self._readers.clear()


def alive_node_ids() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
