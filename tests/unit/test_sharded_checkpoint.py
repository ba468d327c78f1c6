"""A sharded engine's checkpoint: each rank writes its own pieces; reading assembles the canonical state."""

import pytest
import torch

from baige_ray.api.errors import CheckpointError
from baige_ray.checkpoint.sharded import write_rank_part
from baige_ray.checkpoint.store import (
    begin_checkpoint,
    commit_checkpoint,
    load_checkpoint,
    load_latest_good,
    write_checkpoint,
)
from baige_ray.parallel.boxes import Box
from baige_ray.parallel.shards import ShardedPart, assemble
from tests.unit.fixtures.checkpoint_states import assert_states_equal, flip_byte


def _parts() -> list[ShardedPart]:
    """Two ranks' pieces of a 5x4 weight (rows 0-2, 3-4) and its Adam state; a bias kept whole by both."""
    torch.manual_seed(0)
    weight, moment, bias = torch.randn(5, 4), torch.rand(5, 4), torch.randn(4)
    parts = []
    for start, size in ((0, 3), (3, 2)):
        rows = slice(start, start + size)
        state = {"model": {"w": weight[rows].clone(), "b": bias.clone()},
                 "optimizer": {"w": {"step": torch.tensor(3.0), "exp_avg": moment[rows].clone(),
                                     "exp_avg_sq": moment[rows] ** 2}}}
        parts.append(ShardedPart(state, {"w": Box((5, 4), (start, 0), (size, 4)), "b": Box.whole((4,))}))
    return parts


def _write(root, step: int, parts: list[ShardedPart]):
    staging = begin_checkpoint(root, step)
    files = {}
    for rank, part in enumerate(parts):  # each rank, in its own process, writes its own
        files.update(write_rank_part(staging, rank, part))
    return commit_checkpoint(root, staging, step, files, meta={"layout": "DP2 (fsdp2)"}, ranks=len(parts))


def test_every_rank_writes_its_pieces_and_reading_assembles_the_whole_state(tmp_path):
    parts = _parts()
    path = _write(tmp_path, 5, parts)
    step, state, meta = load_checkpoint(path)
    assert step == 5 and meta == {"layout": "DP2 (fsdp2)"}
    assert_states_equal(state, assemble(parts))
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("rank-")) == [
        "rank-00000.json", "rank-00000.safetensors", "rank-00001.json", "rank-00001.safetensors"]


def test_a_damaged_rank_file_is_named_and_the_previous_checkpoint_loads(tmp_path, caplog):
    older = write_checkpoint(tmp_path, 2, assemble(_parts()), meta={})
    newer = _write(tmp_path, 5, _parts())
    flip_byte(newer / "rank-00001.safetensors")
    with pytest.raises(CheckpointError, match="rank-00001.safetensors fails its SHA-256 check"):
        load_checkpoint(newer)
    step, state, _ = load_latest_good(tmp_path)
    assert step == 2 and older.is_dir()
    assert "skipping checkpoint of step 5" in caplog.text
    (older / "COMMITTED").unlink()
    (newer / "rank-00001.json").unlink()
    with pytest.raises(CheckpointError, match="rank-00001.json is missing"):
        load_checkpoint(newer)
