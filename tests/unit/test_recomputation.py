"""Activation recomputation (ParallelLayout.recompute="full"): each transformer block keeps its input
alone for backward and runs its forward again there. Training is unchanged (the losses of one process
without it, alone, and on two ranks under FSDP2, DeepSpeed's ZeRO-3, TP, PP and CP), parameter names are unchanged,
and what a forward stores for backward falls as the memory model says it does."""

import pytest
import torch
import torch.distributed as dist

from baige_ray.parallel.layout import ParallelLayout, parse_layout
from tests.helpers import spawn_ranks

STEPS = 3
RECOMPUTED = ("dp=2,engine=fsdp2,recompute=full", "dp=2,engine=zero3,recompute=full", "tp=2,recompute=full",
              "pp=2,micro=2,recompute=full", "cp=2,recompute=full")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.hf_helpers import build_tiny_hf

    return build_tiny_hf(tmp_path_factory.mktemp("recompute"))


def job(tiny):
    from baige_ray import TrainConfig
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from baige_ray.models.token_dataset import TokenDataset
    from tests.hf_helpers import SEQ_LEN

    train = TrainConfig(num_steps=STEPS, global_batch_size=4, micro_batch_size=2, warmup_steps=0, seed=3)
    return TrainJob(model=HFModel(tiny.model_dir, seq_len=SEQ_LEN), train=train, data=TokenDataset.open(tiny.dataset_dir))


def _two_ranks(rank: int, port: int, results, tiny) -> None:
    import os

    from baige_ray.engines.factory import build_engine

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for text in RECOMPUTED:
        engine = build_engine(job(tiny), parse_layout(text), rank)
        results[(text, rank)] = [engine.train_step(step)["loss"] for step in range(STEPS)]
    dist.destroy_process_group()


def saved_bytes(engine) -> int:
    """Bytes one forward of the engine's model keeps for backward (each storage counted once)."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    inputs, _ = engine.data.batch(range(2), 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        engine.stages[0](inputs)
    return sum(storages.values())


def test_recomputed_blocks_train_as_stored_ones_alone_and_under_fsdp2_zero3_tp_pp_and_cp(tiny):
    from baige_ray.engines.factory import build_engine

    stored = build_engine(job(tiny), ParallelLayout())
    recomputed = build_engine(job(tiny), ParallelLayout(recompute="full"))
    assert [name for name, _ in recomputed.module.named_parameters()] == [n for n, _ in stored.module.named_parameters()]
    print(f"saved for backward by one forward: {saved_bytes(stored)} bytes stored, {saved_bytes(recomputed)} recomputed")
    assert saved_bytes(recomputed) < 0.5 * saved_bytes(stored)
    reference = [stored.train_step(step)["loss"] for step in range(STEPS)]
    assert [recomputed.train_step(step)["loss"] for step in range(STEPS)] == pytest.approx(reference, rel=1e-6)
    ranks = spawn_ranks(_two_ranks, 2, tiny)
    for text in RECOMPUTED:
        layout = parse_layout(text)
        per_rank = (ranks[(text, 0)], ranks[(text, 1)])
        # data-parallel ranks each report their half; tensor- and context-parallel peers the whole; the last
        # pipeline stage the loss
        losses = ([sum(pair) / 2 for pair in zip(*per_rank)] if layout.dp > 1 else
                  per_rank[1] if layout.pp > 1 else per_rank[0])
        assert losses == pytest.approx(reference, rel=1e-5), text


def test_recomputation_is_named_in_the_layout_priced_and_refused_for_experts(tiny):
    from baige_ray.planner.fits import device_bytes, layout_shape

    layout = parse_layout("dp=2,recompute=full")
    assert layout.recompute == "full" and layout.describe() == "DP2 (ddp, full recompute)"
    with pytest.raises(ValueError, match="ParallelLayout.recompute='selective' is invalid"):
        ParallelLayout(recompute="selective")
    spec = job(tiny).plugin.model_spec(global_batch=4)
    layers = (spec.num_layers,)
    activations = [device_bytes(spec, layout_shape(ParallelLayout(recompute=kind), job(tiny).train, layers,
                                                   compute_dtype_bytes=4))[1][0]
                   for kind in ("none", "full")]
    assert activations[1] < activations[0]
