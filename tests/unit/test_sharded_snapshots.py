"""Sharded snapshots: each FSDP2 rank copies its own pieces, with no collective, and the pieces of every
rank assemble to exactly the state a gathered export gives.

Two gloo ranks train a tiny Llama whose dimensions do not divide by two, so the shards are uneven.
"""

import pytest
import torch
import torch.distributed as dist

from baige_ray import TrainConfig
from baige_ray.parallel.boxes import Box
from baige_ray.parallel.shards import ShardedPart, assemble, assemble_lazily
from tests.helpers import spawn_ranks


def test_pieces_of_every_rank_assemble_to_the_full_tensor_and_a_missing_one_is_named():
    full = torch.arange(30.0).reshape(5, 6)
    rows = [ShardedPart({"model": {"w": full[:3].clone()}, "optimizer": {}}, {"w": Box((5, 6), (0, 0), (3, 6))}),
            ShardedPart({"model": {"w": full[3:].clone()}, "optimizer": {}}, {"w": Box((5, 6), (3, 0), (2, 6))})]
    flat = [ShardedPart({"model": {"w": full.view(-1)[:16].clone()}, "optimizer": {}}, {"w": Box((5, 6), (0,), (16,), flat=True)}),
            ShardedPart({"model": {"w": full.view(-1)[16:].clone()}, "optimizer": {}}, {"w": Box((5, 6), (16,), (14,), flat=True)})]
    assert torch.equal(assemble(rows)["model"]["w"], full)
    assert torch.equal(assemble(flat)["model"]["w"], full)
    assert torch.equal(assemble([rows[0], rows[0], rows[1]])["model"]["w"], full)  # replicas counted once
    with pytest.raises(ValueError, match="'w' cover 18 of its 30"):
        assemble(rows[:1])


def test_a_box_of_an_assembled_tensor_is_built_from_the_pieces_it_meets_and_nothing_else():
    full = torch.arange(30.0).reshape(5, 6)
    rows = [ShardedPart({"model": {"w": full[:3].clone()}, "optimizer": {"w": {"step": torch.tensor(4.0),
             "exp_avg": -full[:3].clone(), "exp_avg_sq": full[:3] ** 2}}}, {"w": Box((5, 6), (0, 0), (3, 6))}),
            ShardedPart({"model": {"w": full[3:].clone()}, "optimizer": {"w": {"step": torch.tensor(4.0),
             "exp_avg": -full[3:].clone(), "exp_avg_sq": full[3:] ** 2}}}, {"w": Box((5, 6), (3, 0), (2, 6))})]
    flat = [ShardedPart({"model": {"w": full.view(-1)[:16].clone()}, "optimizer": {}}, {"w": Box((5, 6), (0,), (16,), flat=True)}),
            ShardedPart({"model": {"w": full.view(-1)[16:].clone()}, "optimizer": {}}, {"w": Box((5, 6), (16,), (14,), flat=True)})]
    state = assemble_lazily(rows)
    kept = state["model"].piece("w", Box((5, 6), (3, 0), (2, 6)))
    assert kept.data_ptr() == rows[1].state["model"]["w"].data_ptr()  # the rank's own piece, not a copy
    straddling = Box((5, 6), (2, 1), (2, 3))
    assert torch.equal(state["model"].piece("w", straddling), full[2:4, 1:4])
    moments = state["optimizer"].piece("w", straddling)
    assert torch.equal(moments["exp_avg"], -full[2:4, 1:4]) and torch.equal(moments["exp_avg_sq"], full[2:4, 1:4] ** 2)
    assert moments["step"].item() == 4.0
    assert torch.equal(state["model"].piece("w", Box((5, 6), (10,), (12,), flat=True)), full.view(-1)[10:22])
    assert torch.equal(assemble_lazily(flat)["model"].piece("w", straddling), full[2:4, 1:4])
    assert "w" in state["model"] and "v" not in state["model"]


def _run(rank: int, port: int, results, model_dir: str, data_dir: str) -> None:
    import os

    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from baige_ray.models.token_dataset import TokenDataset
    from baige_ray.parallel.layout import ParallelLayout
    from tests.hf_helpers import SEQ_LEN

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    job = TrainJob(model=HFModel(model_dir, seq_len=SEQ_LEN), data=TokenDataset.open(data_dir),
                   train=TrainConfig(num_steps=4, global_batch_size=4, warmup_steps=1, seed=3))
    layout = ParallelLayout(dp=2, data_parallel="fsdp2")
    engine = build_engine(job, layout, rank)
    for step in range(2):
        engine.train_step(step)
    first = engine.snapshot_state()
    engine.train_step(2)
    part = engine.snapshot_state(into=first)  # written over the first: no allocation in steady state
    parts = [None, None]
    dist.all_gather_object(parts, part)
    gathered = engine.export_state()
    assembled = assemble(parts)
    fresh = build_engine(job, layout, rank)
    fresh.import_state(assemble_lazily(parts))  # each rank fills only its own boxes, as a recovery does
    results[rank] = {
        "sharded": engine.snapshot_is_sharded and engine.snapshot_is_local and isinstance(part, ShardedPart),
        "reused": all(part.state["model"][n].data_ptr() == first.state["model"][n].data_ptr() for n in part.boxes),
        "fraction": part.nbytes / ShardedPart(assembled, {}).nbytes,
        "equal": rank != 0 or all(
            torch.equal(assembled[section][name][key] if section == "optimizer" else assembled[section][name],
                        gathered[section][name][key] if section == "optimizer" else gathered[section][name])
            for section in ("model", "optimizer") for name in gathered[section]
            for key in (("step", "exp_avg", "exp_avg_sq") if section == "optimizer" else (None,))),
        "next": (engine.train_step(3)["loss"], fresh.train_step(3)["loss"]),
    }
    dist.destroy_process_group()


def test_fsdp2_ranks_snapshot_their_own_shards_which_assemble_to_the_gathered_state(tmp_path):
    from tests.hf_helpers import build_tiny_hf

    tiny = build_tiny_hf(tmp_path)
    results = spawn_ranks(_run, 2, str(tiny.model_dir), str(tiny.dataset_dir))
    for rank, outcome in results.items():
        assert outcome["sharded"] and outcome["reused"], rank
        assert 0.4 < outcome["fraction"] < 0.6, rank  # about half the state, not all of it
        assert outcome["equal"], rank
        assert outcome["next"][0] == outcome["next"][1], rank
