"""Sharded snapshots under DeepSpeed ZeRO-3: each rank copies its own slices of the flattened fp32 masters
and Adam moments, with no collective, beside the next step's forward and backward; the slices of every
rank assemble to exactly the state a gathered export gives, and a fresh engine continues from them exactly.

Two gloo ranks train a tiny Llama, whose tensors all divide by two, and a small GPT whose hidden size (45)
is odd, so most of its flattened tensors do not: ZeRO-3 pads them, and the last rank's partition holds
padding that the snapshot must drop (and that import must add back: DeepSpeed's own full setters cannot).
"""

import math
import threading

import torch
import torch.distributed as dist

from baige_ray import TrainConfig
from baige_ray.parallel.shards import ShardedPart, assemble
from tests.helpers import spawn_ranks

# Both precisions, both shapes, in two engines' time (all four combinations pass too, in ~12 s more).
CASES = (("llama", "fp32"), ("odd-gpt", "bf16-mixed"))


def _equal(assembled, gathered) -> bool:
    same = [torch.equal(assembled["model"][name], value) for name, value in gathered["model"].items()]
    same += [torch.equal(assembled["optimizer"][name][key], value)
             for name, adam in gathered["optimizer"].items() for key, value in adam.items()]
    return all(same) and assembled["model"].keys() == gathered["model"].keys() \
        and assembled["optimizer"].keys() == gathered["optimizer"].keys()


def _run(rank: int, port: int, results, model_dir: str, data_dir: str) -> None:
    import os
    from datetime import timedelta

    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.models.hf import HFModel
    from baige_ray.models.token_dataset import TokenDataset
    from baige_ray.parallel.layout import ParallelLayout
    from tests.hf_helpers import SEQ_LEN

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A snapshot that joined a collective the other rank is not in fails here rather than hanging.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    outcome = {}
    for model, precision in CASES:
        train = TrainConfig(num_steps=4, global_batch_size=4, warmup_steps=1, seed=3, precision=precision)
        if model == "llama":
            job = TrainJob(model=HFModel(model_dir, seq_len=SEQ_LEN), data=TokenDataset.open(data_dir), train=train)
        else:
            job = TrainJob(model=GPTConfig(seq_len=16, hidden=45, num_heads=3, num_layers=2, ffn_hidden=91),
                           train=train)
        layout = ParallelLayout(dp=2, data_parallel="zero3")
        engine = build_engine(job, layout, rank)
        for step in range(2):
            engine.train_step(step)
        first = engine.snapshot_state()
        if rank == 0:
            engine.snapshot_state()  # a snapshot on one rank alone: no collective to wait for the other
        engine.train_step(2)
        gathered = engine.export_state()  # collective: the full state after step 2 (kept by rank 0)
        # The snapshot after step 2 runs beside step 3's forward and backward (whose ZeRO-3 all-gathers
        # run on the training thread) and is waited for just before the update, as flash snapshots are.
        taken = {}
        copying = threading.Thread(target=lambda: taken.update(part=engine.snapshot_state(into=first)))
        engine.before_update_hooks.append(copying.join)
        copying.start()
        next_loss = engine.train_step(3)["loss"]
        engine.before_update_hooks.remove(copying.join)
        part = taken["part"]
        parts = [None, None]
        dist.all_gather_object(parts, part)
        assembled = assemble(parts)
        fresh = build_engine(job, layout, rank)
        fresh.import_state(assembled)
        full_numel = {name: math.prod(box.shape) for name, box in part.boxes.items()}
        outcome[model, precision] = {
            "sharded": engine.snapshot_is_sharded and engine.snapshot_is_local and isinstance(part, ShardedPart),
            "reused": all(part.state["model"][n].data_ptr() == first.state["model"][n].data_ptr() for n in part.boxes)
            and all(part.state["optimizer"][n][k].data_ptr() == first.state["optimizer"][n][k].data_ptr()
                    for n in part.state["optimizer"] for k in ("exp_avg", "exp_avg_sq")),
            "fraction": part.nbytes / ShardedPart(assembled, {}).nbytes,
            "dtypes": sorted({str(t.dtype) for t in part.state["model"].values()}),
            "uneven": sum(1 for n, box in part.boxes.items()
                          if box.size[0] != (full_numel[n] + 1) // 2),  # rank 1's trimmed partitions
            "odd": sum(1 for numel in full_numel.values() if numel % 2),
            "equal": _equal(assembled, gathered) if rank == 0 else not gathered["model"],  # rank 0 owns it
            "next": (next_loss, fresh.train_step(3)["loss"]),
        }
    results[rank] = outcome
    dist.destroy_process_group()


def test_zero3_ranks_snapshot_their_own_partitions_which_assemble_to_the_gathered_state(tmp_path):
    from tests.hf_helpers import build_tiny_hf

    tiny = build_tiny_hf(tmp_path)
    results = spawn_ranks(_run, 2, str(tiny.model_dir), str(tiny.dataset_dir))
    assert sorted(results) == [0, 1]
    for rank, outcome in results.items():
        for case in CASES:
            got = outcome[case]
            where = f"rank {rank}, {case}"
            assert got["sharded"] and got["reused"], where
            assert 0.45 < got["fraction"] < 0.55, where  # about half the state, not all of it
            assert got["dtypes"] == ["torch.float32"], where  # the fp32 masters, not the bf16 weights
            assert (got["odd"] > 0) == (case[0] == "odd-gpt"), where
            # rank 0 holds ceil(numel / 2) of every tensor, rank 1 the rest (padding dropped)
            assert got["uneven"] == (0 if rank == 0 else got["odd"]), where
            assert got["equal"], where
            assert got["next"][0] == got["next"][1], where


def _survivor_beside_a_new_process(rank: int, port: int, results) -> None:
    import os
    from datetime import timedelta

    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))  # a hang fails
    if rank == 0:  # DeepSpeed's per-process counts, as a survivor's process holds them after its first engine
        Init.param_id = 1000
        DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 500
    job = TrainJob(model=GPTConfig(seq_len=16, hidden=32, num_heads=2, num_layers=2),
                   train=TrainConfig(num_steps=3, global_batch_size=4))
    engine = build_engine(job, ParallelLayout(dp=2, data_parallel="zero3"), rank)
    results[rank] = [engine.train_step(step)["loss"] for step in range(3)]
    dist.destroy_process_group()


def test_a_survivors_new_zero3_engine_trains_beside_a_replacements(tmp_path):
    """After a failure a survivor builds its second ZeRO-3 engine while its replacement, a new process,
    builds its first: ZeRO-3 checks at the second step that both traced the same parameter and module
    ids, which DeepSpeed numbers per process; the engines number them from 0 each time (a hang before)."""
    results = spawn_ranks(_survivor_beside_a_new_process, 2)
    assert sorted(results) == [0, 1] and all(len(losses) == 3 and all(map(math.isfinite, losses))
                                             for losses in results.values())
