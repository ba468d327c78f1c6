"""bf16 mixed precision: bfloat16 compute, fp32 weights and optimizer state, exact state moves.

Two gloo ranks train a tiny Llama with FSDP2 (its mixed-precision policy) and DeepSpeed ZeRO-3 (its bf16
mode). The losses stay near those of `transformers` in fp32 (bf16 rounds to 3 significant digits), the
exported state is fp32,
and a state exported mid-run and imported into a fresh engine continues exactly: ZeRO's fp32 masters
are restored from the state, not re-derived from the rounded bf16 weights.
"""

import pytest
import torch
import torch.distributed as dist

from baige_ray import TrainConfig
from tests.helpers import spawn_ranks

LAYOUTS = ("fsdp2", "zero3")


def _train(precision: str) -> TrainConfig:
    return TrainConfig(num_steps=3, global_batch_size=4, warmup_steps=1, seed=2, precision=precision)


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
    outcome = {}
    for kind in LAYOUTS:
        job = TrainJob(model=HFModel(model_dir, seq_len=SEQ_LEN), train=_train("bf16-mixed"),
                       data=TokenDataset.open(data_dir))
        layout = ParallelLayout(dp=2, data_parallel=kind)
        engine = build_engine(job, layout, rank)
        losses = [engine.train_step(step)["loss"] for step in range(2)]
        state = _full_state(engine)
        fresh = build_engine(job, layout, rank)
        fresh.import_state(state)
        moved = _full_state(fresh)
        outcome[kind] = {
            "losses": losses,
            "dtypes": sorted({str(t.dtype) for t in state["model"].values()}),
            "moved_exactly": all(torch.equal(state["model"][name], moved["model"][name]) for name in state["model"]),
            "next": (engine.train_step(2)["loss"], fresh.train_step(2)["loss"]),
        }
    results[rank] = outcome
    dist.destroy_process_group()


def _full_state(engine):
    """The canonical state from every rank's snapshot (its own shards where the engine shards it)."""
    from baige_ray.parallel.shards import assemble

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, engine.snapshot_state())
    return assemble(parts)


def test_bf16_mixed_keeps_fp32_state_and_moves_it_exactly(tmp_path):
    from baige_ray.models.token_dataset import TokenDataset
    from tests.hf_helpers import build_tiny_hf, plain_transformers_losses

    tiny = build_tiny_hf(tmp_path)
    outcome = spawn_ranks(_run, 2, str(tiny.model_dir), str(tiny.dataset_dir))[0]
    full = plain_transformers_losses(tiny.model_dir, TokenDataset.open(tiny.dataset_dir), _train("fp32"), num_steps=2)
    for kind in LAYOUTS:
        mixed = outcome[kind]
        assert mixed["losses"] == pytest.approx(full, rel=1e-2), kind
        assert mixed["losses"] != pytest.approx(full, rel=1e-6), f"{kind}: bf16 compute should round unlike fp32"
        assert mixed["dtypes"] == ["torch.float32"], kind
        assert mixed["moved_exactly"], kind
        assert mixed["next"][0] == mixed["next"][1], kind


def test_an_unknown_precision_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="TrainConfig.precision"):
        TrainConfig(num_steps=1, precision="fp16")
