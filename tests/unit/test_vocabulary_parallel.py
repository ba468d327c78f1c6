"""Tensor parallelism splits a tied embedding and head by vocabulary rows, as one shared shard.

Two gloo ranks train a tiny tied Qwen2 whose vocabulary (387 rows) does not divide by two, so the
shards are uneven (194 and 193 rows); the losses must be those of `transformers` trained alone.
"""

import torch
import torch.distributed as dist

from tests.helpers import spawn_ranks

VOCAB = 387


def _train_tp2(rank: int, port: int, results, model_dir: str, data_dir: str) -> None:
    import os

    from torch.distributed.tensor import DTensor, Shard

    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from baige_ray.models.token_dataset import TokenDataset
    from baige_ray.parallel.layout import ParallelLayout
    from tests.hf_helpers import SEQ_LEN

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    job = TrainJob(model=HFModel(model_dir, seq_len=SEQ_LEN), train=_train(), data=TokenDataset.open(data_dir))
    engine = build_engine(job, ParallelLayout(tp=2), rank)
    stage = engine.stages[0]
    embedding, head = stage.base.embed_tokens.weight, stage.lm_head.weight
    results[rank] = {
        "shared": head is embedding,
        "layout": (isinstance(embedding, DTensor) and embedding.placements == (Shard(0),)),
        "rows": embedding.to_local().shape[0],
        "losses": [engine.train_step(step)["loss"] for step in range(_train().num_steps)],
    }
    dist.destroy_process_group()


def _train():
    from baige_ray import TrainConfig

    return TrainConfig(num_steps=4, global_batch_size=4, warmup_steps=1, seed=3)


def test_tied_embedding_and_head_share_one_uneven_vocabulary_shard(tmp_path):
    from baige_ray.models.token_dataset import TokenDataset
    from tests.hf_helpers import build_tiny_hf, plain_transformers_losses, qwen2_tied_config

    tiny = build_tiny_hf(tmp_path, family=qwen2_tied_config, vocab_size=VOCAB)
    results = spawn_ranks(_train_tp2, 2, str(tiny.model_dir), str(tiny.dataset_dir))
    assert [results[rank]["shared"] for rank in (0, 1)] == [True, True]
    assert [results[rank]["layout"] for rank in (0, 1)] == [True, True]
    assert [results[rank]["rows"] for rank in (0, 1)] == [194, 193]
    reference = plain_transformers_losses(tiny.model_dir, TokenDataset.open(tiny.dataset_dir), _train())
    for rank in (0, 1):
        torch.testing.assert_close(results[rank]["losses"], reference, rtol=1e-5, atol=0)
