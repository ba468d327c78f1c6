"""Who trains, in rank order, with which layout and generation: kept in Ray's internal key-value store
(in the GCS, beside the actors) so a controller Ray restarted finds the workers its predecessor led."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

from baige_ray.elastic.workers import Worker
from baige_ray.engines.layout import ParallelLayout


@dataclass(frozen=True)
class SavedMember:
    name: str
    speed: float
    share: float


@dataclass(frozen=True)
class SavedJob:
    members: tuple[SavedMember, ...]
    layout: ParallelLayout
    generation: int


class JobRecord:
    def __init__(self, run_name: str):
        self.key = f"baige:job:{run_name}"

    def save(self, members: list[Worker], layout: ParallelLayout, generation: int) -> None:
        record = {"workers": [w.name for w in members], "speeds": [w.speed for w in members],
                  "shares": [w.share for w in members], "layout": dataclasses.asdict(layout), "generation": generation}
        _internal_kv_put(self.key, json.dumps(record), overwrite=True)

    def load(self) -> SavedJob | None:
        """The last saved group; None if none formed before the controller restarted."""
        raw = _internal_kv_get(self.key)
        if raw is None:
            return None
        record = json.loads(raw)
        layout = ParallelLayout(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["layout"].items()})
        shares = record.get("shares", [1.0] * len(record["workers"]))
        members = tuple(SavedMember(name, speed, share)
                        for name, speed, share in zip(record["workers"], record["speeds"], shares))
        return SavedJob(members=members, layout=layout, generation=record["generation"])

    def delete(self) -> None:
        _internal_kv_del(self.key)
