"""Who trains, in rank order, with which layout and generation: kept in Ray's internal key-value store
(in the GCS, beside the actors) so a controller Ray restarted finds the workers its predecessor led.
The controller's unit tests keep it in a dict (any store with put, get and delete)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Protocol

from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

from baige_ray.elastic.workers import Worker
from baige_ray.parallel.layout import ParallelLayout


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


class KeyValueStore(Protocol):
    def put(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> str | bytes | None: ...

    def delete(self, key: str) -> None: ...


class RayKeyValueStore:
    """Ray's internal key-value store: it outlives the controller actor, not the cluster."""

    def put(self, key: str, value: str) -> None:
        _internal_kv_put(key, value, overwrite=True)

    def get(self, key: str) -> bytes | None:
        return _internal_kv_get(key)

    def delete(self, key: str) -> None:
        _internal_kv_del(key)


class JobRecord:
    def __init__(self, run_name: str, store: KeyValueStore | None = None):
        self.key = f"baige:job:{run_name}"
        self.store = store or RayKeyValueStore()

    def save(self, members: list[Worker], layout: ParallelLayout, generation: int) -> None:
        record = {"workers": [w.name for w in members], "speeds": [w.speed for w in members],
                  "shares": [w.share for w in members], "layout": dataclasses.asdict(layout), "generation": generation}
        self.store.put(self.key, json.dumps(record))

    def load(self) -> SavedJob | None:
        """The last saved group; None if none formed before the controller restarted."""
        raw = self.store.get(self.key)
        if raw is None:
            return None
        record = json.loads(raw)
        layout = ParallelLayout(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["layout"].items()})
        shares = record.get("shares", [1.0] * len(record["workers"]))
        members = tuple(SavedMember(name, speed, share)
                        for name, speed, share in zip(record["workers"], record["speeds"], shares))
        return SavedJob(members=members, layout=layout, generation=record["generation"])

    def note_restart(self, now: float, window_s: float) -> int:
        """Record a controller restart at `now` (wall clock); how many restarts the last `window_s` saw,
        this one included."""
        key = f"{self.key}:restarts"
        raw = self.store.get(key)
        recent = [t for t in (json.loads(raw) if raw is not None else []) if now - t < window_s] + [now]
        self.store.put(key, json.dumps(recent))
        return len(recent)

    def delete(self) -> None:
        self.store.delete(self.key)
        self.store.delete(f"{self.key}:restarts")
