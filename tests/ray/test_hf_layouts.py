"""A Hugging Face model trains under every layout exactly as `transformers` does alone.

The model is a tiny Qwen2 whose head is tied to its input embedding (as Qwen2.5-0.5B's, Llama 3.2 1B's
and Qwen3 0.6B's are): the checkpoint stores the weight once, ZeRO-3 and FSDP2 shard it once, and the
pipeline's first and last stages each hold it and sum its gradient. Untied models of every family run in
the conformance matrix (test_hf_conformance.py). Exported from a tensor- and a pipeline-parallel run, the
directory keeps the tie (one tensor, as `save_pretrained` writes it) and `transformers` scores it with the
loss training reports for the next batch.

One group of 4 worker actors runs DP4, FSDP2 x4, DeepSpeed ZeRO-3 x4, DP2xTP2 and PP2xTP2 in turn
(each a new process-group generation in the same processes); every step's loss must equal that of
the same `transformers` model trained by a plain PyTorch loop over the same batches.
"""

import pytest
import torch

from baige_ray import RunConfig, TrainConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.jobs.fit import train_on_group
from baige_ray.models.hf import HFModel
from baige_ray.models.hf.export import save_hf_checkpoint
from baige_ray.models.token_dataset import TokenDataset
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.state import merge_states

from ..helpers import at_full_speed, worker_group
from ..hf_helpers import SEQ_LEN, build_tiny_hf, plain_transformers_losses, qwen2_tied_config

TRAIN = TrainConfig(num_steps=8, global_batch_size=8, warmup_steps=3, seed=5)
RUN = RunConfig(show_progress=False)
LAYOUTS = {
    "DP4": ParallelLayout(dp=4),
    "FSDP2 x4": ParallelLayout(dp=4, data_parallel="fsdp2"),
    "ZeRO-3 x4 (DeepSpeed)": ParallelLayout(dp=4, data_parallel="zero3"),
    "DP2xTP2": ParallelLayout(dp=2, tp=2),
    "PP2xTP2": ParallelLayout(pp=2, tp=2),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-qwen2-tied"), family=qwen2_tied_config)


@pytest.fixture(scope="module")
def job(tiny):
    return TrainJob(model=HFModel(tiny.model_dir, seq_len=SEQ_LEN), train=TRAIN, data=TokenDataset.open(tiny.dataset_dir))


@pytest.fixture(scope="module")
def reference(tiny, job):
    return plain_transformers_losses(tiny.model_dir, job.data, TRAIN)


@pytest.fixture(scope="module")
def group(local_ray):
    yield from worker_group(4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_plain_transformers_training(group, job, reference, name):
    losses = [m.loss for m in train_on_group(group, job, at_full_speed(LAYOUTS[name]), RUN)]
    assert losses == pytest.approx(reference, rel=1e-4)


def test_state_moves_from_a_pipeline_layout_to_zero3(group, job, reference):
    half = TRAIN.num_steps // 2
    train_on_group(group, job, at_full_speed(LAYOUTS["PP2xTP2"]), RUN, end_step=half)
    state = merge_states(group.call("export_state"))
    assert "model.layers.3.mlp.gate_proj.weight" in state["model"]  # the checkpoint's own names
    resumed = train_on_group(group, job, at_full_speed(LAYOUTS["ZeRO-3 x4 (DeepSpeed)"]), RUN, start_step=half,
                             initial_state=state)
    assert [m.loss for m in resumed] == pytest.approx(reference[half:], rel=1e-4)


def transformers_loss(directory, inputs, targets) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # transformers ties what it loads
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))


@pytest.mark.parametrize("name", ["DP2xTP2", "PP2xTP2"])
def test_tied_export_scores_the_loss_training_reported(group, job, name, tmp_path):
    from safetensors import safe_open

    half = TRAIN.num_steps // 2
    execution = at_full_speed(LAYOUTS[name])
    train_on_group(group, job, execution, RUN, end_step=half)
    state = merge_states(group.call("export_state"))
    assert "lm_head.weight" not in state["model"]  # one weight, under the embedding's name
    directory = save_hf_checkpoint(tmp_path / "export", state["model"], job.model, step=half)
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        assert "lm_head.weight" not in handle.keys() and "model.embed_tokens.weight" in handle.keys()
    (next_step,) = train_on_group(group, job, execution, RUN, start_step=half, end_step=half + 1, initial_state=state)
    inputs, targets = job.data.batch(range(half * TRAIN.global_batch_size, (half + 1) * TRAIN.global_batch_size),
                                     TRAIN.seed)
    assert transformers_loss(directory, inputs, targets) == pytest.approx(next_step.loss, rel=1e-4)
