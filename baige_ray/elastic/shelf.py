"""A worker's newest sharded snapshots in node-local shared memory, where they outlive the worker.

Under FSDP2 or ZeRO-3 a rank's snapshot holds the only copy of its pieces outside its training state,
so a snapshot kept in the worker's own heap would die with the worker. Files under /dev/shm (tmpfs:
memory, not disk) survive the process: a peer on the same node reads a killed worker's pieces from
there, as DLRover's flash checkpoint reads its shared-memory copy after a restart. A lost node takes
its shelves with it; replicas on other nodes or the persisted checkpoint cover that.

A shelf has one or two slots. Each is a file of raw bytes and a manifest naming every tensor's place in
it; the manifest is removed before a slot is written and put back once it is whole, so a worker killed
mid-copy leaves the other slot (with one slot: nothing) to restore from. The engine writes straight
into the slot's mapped tensors, so a steady-state snapshot is one copy and no allocation.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from baige_ray.parallel.boxes import Box
from baige_ray.parallel.shards import ShardedPart

ROOT_ENV = "BAIGE_RAY_SNAPSHOT_DIR"  # where shelves live (default: /dev/shm/baige-ray)
ALIGN = 64


def shelf_root() -> Path:
    configured = os.environ.get(ROOT_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "baige-ray"


def shelf_directory(worker_name: str, root: Path | None = None) -> Path:
    """The shelf of the worker named `baige-worker:<run>:<id>`: <root>/<run>/<id>, so a run's are removed together."""
    _, run, worker_id = worker_name.split(":", 2)
    return (root or shelf_root()) / _safe(run) / _safe(worker_id)


def run_shelves(run_name: str, root: Path | None = None) -> Path:
    return (root or shelf_root()) / _safe(run_name)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


@dataclass(frozen=True)
class ShelfRef:
    """A rank's sharded snapshot of `step` on the shelf of `worker_name` (alive or dead) on node `node_id`:
    a worker on that node maps it directly (no copy); one elsewhere asks `reader`, a live worker there."""

    worker_name: str
    node_id: str
    step: int
    reader: Any  # the reader's ActorHandle


class SnapshotShelf:
    def __init__(self, directory: Path, slots: int = 2):
        if slots not in (1, 2):
            raise ValueError(f"SnapshotShelf.slots must be 1 or 2, got {slots}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.slots = slots
        self._mapped: dict[int, tuple[tuple, ShardedPart, str]] = {}  # slot -> (layout key, its tensors, file)
        self._generation = 0  # numbers the data files this shelf creates
        self._newest = _newest_slot(self.directory, slots)

    def begin(self, layout: ShardedPart | None = None) -> ShardedPart | None:
        """Invalidate the slot the next snapshot goes to and return its tensors to write into, laid out as
        `layout` (meta tensors) says; None when it has none yet and no layout is given (the engine then
        allocates, and `commit` copies: twice the memory for a moment)."""
        slot = self._next_slot()
        _manifest(self.directory, slot).unlink(missing_ok=True)
        if self._newest == slot:
            self._newest = None
        if layout is not None:
            return self._mapped_as(slot, layout)[1]
        mapped = self._mapped.get(slot)
        return mapped[1] if mapped is not None else None

    def commit(self, step: int, part: ShardedPart) -> ShardedPart:
        """Store `part` as the snapshot after `step` in the slot `begin` opened; returns it as stored."""
        slot = self._next_slot()
        mapped = self._mapped_as(slot, part)
        stored = mapped[1]
        for (_, _, target), (_, _, source) in zip(_entries(stored), _entries(part)):
            if target.data_ptr() != source.data_ptr():
                target.copy_(source)
        _write_manifest(self.directory, slot, step, part, data=mapped[2])
        self._newest = slot
        return stored

    def _mapped_as(self, slot: int, like: ShardedPart) -> tuple[tuple, ShardedPart, str]:
        """The slot's tensors, laid out as `like`'s (a new file when they are not)."""
        key = _layout_key(like)
        mapped = self._mapped.get(slot)
        if mapped is not None and mapped[0] == key:
            return mapped
        # A new file: the old one may still be mapped (the engine may have written into it), and
        # truncating a mapped file faults every access past its new end.
        self._generation += 1
        data = f"slot{slot}-{os.getpid()}-{self._generation}.bin"
        mapped = self._mapped[slot] = (key, _map(self.directory / data, like, create=True), data)
        for stale in self.directory.glob(f"slot{slot}-*.bin"):
            if stale.name != data:
                stale.unlink(missing_ok=True)
        return mapped

    def remove(self) -> None:
        self._mapped.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _next_slot(self) -> int:
        """The slot not holding the newest snapshot (the only one, with one slot)."""
        if self.slots == 1 or self._newest is None:
            return 0
        return 1 - self._newest


class ShelfReader:
    """Reads and removes the shelves of a node's workers, dead or alive, for a worker on another node.

    Every elastic worker answers these for its node; a job with no live worker left on a node runs
    one of these there on its own (shelf_readers.py), so what its dead ranks left is not lost."""

    def shelf_steps_of(self, worker_name: str) -> list[int]:
        """The steps of the whole snapshots on the shelf of `worker_name`, newest first."""
        return shelf_steps(shelf_directory(worker_name))

    def read_shelf_of(self, worker_name: str, step: int) -> ShardedPart:
        found = read_shelf(shelf_directory(worker_name), step)
        if found is None:
            raise RuntimeError(f"the shelf of {worker_name} holds no snapshot of step {step}")
        return found[1]

    def discard_shelf_of(self, worker_name: str) -> None:
        """Remove the shelf of a worker that died, once its snapshot has been restored."""
        shutil.rmtree(shelf_directory(worker_name), ignore_errors=True)


def shelf_steps(directory: Path) -> list[int]:
    """The steps of the whole snapshots on the shelf at `directory`, newest first."""
    steps = []
    for slot in (0, 1):
        meta = _read_manifest(directory, slot)
        if meta is not None:
            steps.append(meta["step"])
    return sorted(steps, reverse=True)


def read_shelf(directory: Path, step: int | None = None) -> tuple[int, ShardedPart] | None:
    """(step, part) of the newest whole snapshot on the shelf, or of the one after `step`; None if none.
    The tensors are private copy-on-write maps of the slot: reading copies nothing."""
    for slot in (0, 1):
        meta = _read_manifest(directory, slot)
        if meta is not None and (step is None or meta["step"] == step):
            if step is None and (other := _read_manifest(directory, 1 - slot)) is not None and other["step"] > meta["step"]:
                continue
            return meta["step"], _map(directory / meta["data"], _part_from(meta), create=False)
    return None


def _newest_slot(directory: Path, slots: int) -> int | None:
    found = [(meta["step"], slot) for slot in range(slots) if (meta := _read_manifest(directory, slot)) is not None]
    return max(found)[1] if found else None


def _entries(part: ShardedPart):
    """(section, name, tensor) in a fixed order; Adam state under "optimizer/<key>"."""
    for name in sorted(part.state["model"]):
        yield "model", name, part.state["model"][name]
    for name in sorted(part.state["optimizer"]):
        for key in sorted(part.state["optimizer"][name]):
            yield f"optimizer/{key}", name, part.state["optimizer"][name][key]


def _layout_key(part: ShardedPart) -> tuple:
    return tuple((section, name, tuple(t.shape), str(t.dtype)) for section, name, t in _entries(part))


def _manifest(directory: Path, slot: int) -> Path:
    return directory / f"slot{slot}.json"


def _map(path: Path, like: ShardedPart, *, create: bool) -> ShardedPart:
    """Tensors shaped as `like`'s, laid one after another in the file at `path` (shared with the file
    when `create`: writes land in it; private copy-on-write otherwise)."""
    layout, offset = [], 0
    for section, name, tensor in _entries(like):
        layout.append((section, name, tensor.shape, tensor.dtype, offset))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    if create:
        with open(path, "wb") as handle:
            handle.truncate(max(offset, 1))
    elif path.stat().st_size < offset:
        raise ValueError(f"snapshot slot {path} holds {path.stat().st_size} bytes, its manifest needs {offset}")
    raw = torch.from_file(str(path), shared=create, size=max(offset, 1), dtype=torch.uint8)
    state: dict = {"model": {}, "optimizer": {}}
    for section, name, shape, dtype, start in layout:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        tensor = raw[start:start + nbytes].view(dtype).view(shape)
        if section == "model":
            state["model"][name] = tensor
        else:
            state["optimizer"].setdefault(name, {})[section.split("/", 1)[1]] = tensor
    return ShardedPart(state, dict(like.boxes))


def _write_manifest(directory: Path, slot: int, step: int, part: ShardedPart, data: str) -> None:
    meta = {
        "step": step,
        "data": data,
        "tensors": [[section, name, list(t.shape), str(t.dtype).removeprefix("torch.")]
                    for section, name, t in _entries(part)],
        "boxes": {name: [list(b.shape), list(b.start), list(b.size), b.flat] for name, b in part.boxes.items()},
    }
    staged = directory / f"slot{slot}.json.tmp"
    staged.write_text(json.dumps(meta))
    os.replace(staged, _manifest(directory, slot))


def _read_manifest(directory: Path, slot: int) -> dict | None:
    try:
        return json.loads(_manifest(directory, slot).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _part_from(meta: dict) -> ShardedPart:
    """A part of empty tensors shaped as the manifest says (the layout `_map` lays out)."""
    state: dict = {"model": {}, "optimizer": {}}
    for section, name, shape, dtype in meta["tensors"]:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        if section == "model":
            state["model"][name] = tensor
        else:
            state["optimizer"].setdefault(name, {})[section.split("/", 1)[1]] = tensor
    boxes = {name: Box(tuple(s), tuple(st), tuple(sz), flat) for name, (s, st, sz, flat) in meta["boxes"].items()}
    return ShardedPart(state, boxes)
