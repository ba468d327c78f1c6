"""A Hugging Face mixture-of-experts model (Mixtral) trains under expert-parallel layouts as `transformers` does alone.

The tiny Mixtral is saved by `save_pretrained` (experts one by one, as real checkpoints hold them)
and read back through transformers' loader. Its head is tied to its input embedding (no published
mixture-of-experts config ties them, but nothing stops a user's own), so the tie is kept beside
sharded experts, and under DP2xEP2xTP2 in one vocabulary-parallel shard. Its load-balancing loss is on, so every micro-batch's
loss includes transformers' own router loss; the reference is the `transformers` model in a plain
PyTorch loop over the same micro-batches (2 sequences each) with accumulated gradients.
"""

import pytest
from safetensors import safe_open

from baige_ray import RunConfig, TrainConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.jobs.fit import train_on_group
from baige_ray.models.hf import HFModel
from baige_ray.models.token_dataset import TokenDataset
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.state import merge_states

from ..helpers import at_full_speed, worker_group
from ..hf_helpers import SEQ_LEN, build_tiny_hf, mixtral_config, plain_transformers_losses

TRAIN = TrainConfig(num_steps=8, global_batch_size=8, micro_batch_size=2, warmup_steps=2, seed=4)
RUN = RunConfig(show_progress=False)
LAYOUTS = {  # experts held whole (no EP): tests/unit/test_hf_moe.py, logits and router loss against transformers
    "DP4xEP4": ParallelLayout(dp=4, ep=4),
    "DP2xEP2xTP2": ParallelLayout(dp=2, ep=2, tp=2),
    "ZeRO-2 x4 with EP2 (DeepSpeed)": ParallelLayout(dp=4, ep=2, data_parallel="zero2"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-mixtral"), family=mixtral_config, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def job(tiny):
    return TrainJob(model=HFModel(tiny.model_dir, seq_len=SEQ_LEN), train=TRAIN, data=TokenDataset.open(tiny.dataset_dir))


@pytest.fixture(scope="module")
def reference(tiny, job):
    return plain_transformers_losses(tiny.model_dir, job.data, TRAIN)


@pytest.fixture(scope="module")
def group(local_ray):
    yield from worker_group(4)


def test_the_checkpoint_holds_experts_one_by_one(tiny):
    with safe_open(str(tiny.model_dir / "model.safetensors"), "pt") as handle:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in handle.keys()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mixtral_layout_matches_plain_transformers_training(group, job, reference, name):
    losses = [m.loss for m in train_on_group(group, job, at_full_speed(LAYOUTS[name]), RUN)]
    assert losses == pytest.approx(reference, rel=1e-4)


def test_mixtral_experts_reshard_from_ep4_to_ep2(group, job, reference):
    half = TRAIN.num_steps // 2
    train_on_group(group, job, at_full_speed(LAYOUTS["DP4xEP4"]), RUN, end_step=half)
    state = merge_states(group.call("export_state"))
    assert state["model"]["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 192, 64)  # every expert, fused
    resumed = train_on_group(group, job, at_full_speed(ParallelLayout(dp=4, ep=2)), RUN, start_step=half,
                             initial_state=state)
    assert [m.loss for m in resumed] == pytest.approx(reference[half:], rel=1e-4)


def test_pipelining_is_refused_while_the_router_loss_couples_every_layer(job):
    with pytest.raises(ValueError, match="output_router_logits"):
        job.plugin.check_layout(ParallelLayout(pp=2, dp=2))
