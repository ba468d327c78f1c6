"""A sharded engine's checkpoint written by its ranks in parallel, each the pieces it keeps.

Every rank writes its snapshot's pieces (a `ShardedPart`: 1/dp of the weights and Adam state under FSDP2
or ZeRO-3) straight from its snapshot shelf into the checkpoint's staging directory:

    rank-00003.safetensors   {"model/<name>": piece, "optimizer/<name>/<key>": piece}
    rank-00003.json          each name's `Box`: where its piece sits in the full tensor

No rank and no controller ever holds the whole state to write it; store.py commits the directory once
every rank's files are in, and reading assembles the canonical state from all ranks' pieces.
"""

from __future__ import annotations

import json
from pathlib import Path

from baige_ray.api.errors import CheckpointError
from baige_ray.checkpoint.files import file_record, write_json_atomically
from baige_ray.checkpoint.tensor_file import read_tensor_file, write_tensor_file
from baige_ray.parallel.boxes import Box
from baige_ray.parallel.shards import ShardedPart

SEPARATOR = "/"


def rank_files(rank: int) -> tuple[str, str]:
    """(tensor file, box file) of rank `rank`."""
    return f"rank-{rank:05d}.safetensors", f"rank-{rank:05d}.json"


def sharded_files(ranks: int) -> list[str]:
    return [name for rank in range(ranks) for name in rank_files(rank)]


def write_rank_part(directory: Path, rank: int, part: ShardedPart) -> dict[str, dict]:
    """Write rank `rank`'s pieces into `directory`; returns the manifest records of its two files."""
    tensors, boxes = rank_files(rank)
    flat = {f"model{SEPARATOR}{name}": tensor for name, tensor in part.state["model"].items()}
    for name, moments in part.state["optimizer"].items():
        flat.update({f"optimizer{SEPARATOR}{name}{SEPARATOR}{key}": value for key, value in moments.items()})
    records = {tensors: write_tensor_file(Path(directory) / tensors, flat)}
    write_json_atomically(Path(directory) / boxes, {name: _box_record(box) for name, box in part.boxes.items()})
    records[boxes] = file_record(Path(directory) / boxes)
    return records


def read_rank_part(directory: Path, rank: int) -> ShardedPart:
    tensors, boxes = rank_files(rank)
    flat = read_tensor_file(Path(directory) / tensors)
    try:
        placed = {name: _box(record) for name, record in json.loads((Path(directory) / boxes).read_text()).items()}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{Path(directory) / boxes} does not say where rank {rank}'s pieces sit: {error}") from None
    state: dict = {"model": {}, "optimizer": {}}
    for key, tensor in flat.items():
        section, rest = key.split(SEPARATOR, 1)
        if section == "model":
            state["model"][rest] = tensor
        else:
            name, moment = rest.rsplit(SEPARATOR, 1)
            state["optimizer"].setdefault(name, {})[moment] = tensor
    unplaced = sorted(set(state["model"]) - set(placed))
    if unplaced:
        raise CheckpointError(f"{Path(directory) / boxes} places no piece of {unplaced[:3]}")
    return ShardedPart(state, placed)


def _box_record(box: Box) -> dict:
    return {"shape": list(box.shape), "start": list(box.start), "size": list(box.size), "flat": box.flat}


def _box(record: dict) -> Box:
    return Box(tuple(record["shape"]), tuple(record["start"]), tuple(record["size"]), bool(record["flat"]))
