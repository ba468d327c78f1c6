"""A model whose head is tied to its input embedding (Qwen2.5-0.5B, Llama 3.2 1B, Qwen3 0.6B do), trained with
tensor and with pipeline parallelism, exports a directory that keeps the tie and that `transformers` scores
with the loss training reports for the next batch.

The checkpoint holds one tensor for the two (no `lm_head.weight`, as `save_pretrained` writes it). Under
pipeline parallelism the first and the last stage each hold the weight and sum its gradients. Equality with
`transformers`' own training in every layout: test_hf_layouts.py (this tiny Qwen2) and test_hf_conformance.py.
"""

import pytest
import torch

from baige_ray import RunConfig, TrainConfig
from baige_ray.engines.layout import ParallelLayout
from baige_ray.engines.state import merge_states
from baige_ray.models.hf import HFModel
from baige_ray.models.hf.export import save_hf_checkpoint
from baige_ray.models.token_dataset import TokenDataset
from baige_ray.runtime.fit import train_on_group
from baige_ray.runtime.train_loop import TrainJob

from ..helpers import at_full_speed, worker_group
from ..hf_helpers import SEQ_LEN, build_tiny_hf, qwen2_tied_config

TRAIN = TrainConfig(num_steps=4, global_batch_size=8, warmup_steps=1, seed=3)
RUN = RunConfig(show_progress=False)
LAYOUTS = {"DP2xTP2": ParallelLayout(dp=2, tp=2), "PP2xDP2": ParallelLayout(pp=2, dp=2)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-qwen2-tied"), family=qwen2_tied_config)


@pytest.fixture(scope="module")
def job(tiny):
    return TrainJob(model=HFModel(tiny.model_dir, seq_len=SEQ_LEN), train=TRAIN, data=TokenDataset.open(tiny.dataset_dir))


@pytest.fixture(scope="module")
def group(local_ray):
    yield from worker_group(4)


def transformers_loss(directory, inputs, targets) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # transformers ties what it loads
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))


@pytest.mark.parametrize("name", ["DP2xTP2", "PP2xDP2"])
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
