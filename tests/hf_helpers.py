"""Tiny Hugging Face models, tokenizers and datasets built from local files, and the plain-PyTorch reference.

Nothing is downloaded: a byte-level BPE tokenizer is trained on a few standard-library sources,
a Llama-architecture model is built from a config and saved with `save_pretrained`, and the
dataset is tokenized from the same sources. The reference trains the `transformers` model itself
in one process: same batches, same optimizer, schedule and clipping, no baige-ray engine.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE_FILES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "shlex.py", "fnmatch.py")
VOCAB_SIZE = 384
SEQ_LEN = 32


@dataclass(frozen=True)
class TinyHF:
    model_dir: Path
    tokenizer_dir: Path
    dataset_dir: Path
    text_files: tuple[Path, ...]


def text_files(directory: Path) -> list[Path]:
    """A few standard-library sources copied as plain-text documents."""
    root = Path(sysconfig.get_paths()["stdlib"])
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for name in SOURCE_FILES:
        target = directory / (name.replace("/", "_") + ".txt")
        target.write_text((root / name).read_text())
        files.append(target)
    return files


# The sizes every tiny dense model here shares; each family function adds its own flags.
TINY_DENSE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)


def llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_DENSE, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **overrides})


def fresh_llama():
    """The tiny Llama of llama_config with seeded random weights, in eval mode (the engine tests' model)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32).eval()


def random_prompts(lengths, seed: int) -> list[list[int]]:
    """Token prompts of `lengths`, drawn from the tiny vocabulary with `seed`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def qwen2_tied_config(**overrides):
    """A tiny Qwen2 whose head is tied to its input embedding (as Qwen2.5-0.5B's is), with QKV biases."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY_DENSE, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, **overrides})


def mixtral_config(**overrides):
    """A tiny Mixtral: 4 experts, top-2, transformers' load-balancing loss on (coefficient 0.05)."""
    from transformers import MixtralConfig

    values = {**TINY_DENSE, "intermediate_size": 96, "num_hidden_layers": 2, "rms_norm_eps": 1e-5,
              "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
              "router_aux_loss_coef": 0.05, "tie_word_embeddings": False}
    return MixtralConfig(**{**values, **overrides})


def build_tiny_hf(root: Path, *, seed: int = 0, family=llama_config, **config_overrides) -> TinyHF:
    """A saved model (`family` makes its config: Llama architecture by default) with its own tokenizer,
    and a TokenDataset of SEQ_LEN sequences."""
    from transformers import AutoModelForCausalLM

    from baige_ray.models.token_dataset import TokenDataset
    from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer

    root = Path(root)
    files = text_files(root / "text")
    tokenizer_dir = train_bpe_tokenizer(files, root / "tokenizer", vocab_size=VOCAB_SIZE)
    tokenizer = load_tokenizer(tokenizer_dir)
    config = family(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    dataset = TokenDataset.build(files, tokenizer=tokenizer_dir, seq_len=SEQ_LEN, directory=root / "data")
    return TinyHF(root / "model", Path(tokenizer_dir), Path(dataset.directory), tuple(files))


def plain_transformers_losses(model_dir: Path, dataset, train, num_steps: int | None = None,
                              device: str = "cpu") -> list[float]:
    return plain_transformers_training(model_dir, dataset, train, num_steps, device)[0]


def plain_transformers_training(model_dir: Path, dataset, train, num_steps: int | None = None,
                                device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    """(losses, final weights) of the `transformers` model trained by a plain PyTorch loop over the global batch, in
    micro-batches of `train.micro_batch_size` (default: all of it) whose gradients accumulate. A
    mixture-of-experts model adds its load-balancing loss per micro-batch, as transformers' forward
    adds it to each batch it sees."""
    from transformers import AutoModelForCausalLM

    from baige_ray.engines.train_job import build_optimizer, learning_rate_at

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.train()
    optimizer = build_optimizer(model, train)
    losses = []
    for step in range(num_steps or train.num_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, train)
        batch = range(step * train.global_batch_size, (step + 1) * train.global_batch_size)
        inputs, targets = (tensor.to(device) for tensor in dataset.batch(batch, train.seed))
        micro = train.micro_batch_size or train.global_batch_size
        loss = 0.0
        for start in range(0, train.global_batch_size, micro):
            output = model(input_ids=inputs[start : start + micro])
            logits = output.logits
            micro_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                           targets[start : start + micro].reshape(-1))
            if getattr(output, "aux_loss", None) is not None:
                micro_loss = micro_loss + model.config.router_aux_loss_coef * output.aux_loss
            (micro_loss * micro / train.global_batch_size).backward()
            loss += micro_loss.item() * micro / train.global_batch_size
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    return losses, {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}


def elastic_hf_train(num_steps: int, *, global_batch_size: int = 24, learning_rate: float = 3e-3,
                     world_size_invariant: bool = False):
    """elastic_hf_run's optimisation problem: a constant learning rate; world_size_invariant in micro-batches
    of one sequence."""
    from baige_ray.api.configs import TrainConfig

    return TrainConfig(num_steps=num_steps, global_batch_size=global_batch_size, warmup_steps=0,
                       learning_rate=learning_rate, min_learning_rate=learning_rate,
                       micro_batch_size=1 if world_size_invariant else None, world_size_invariant=world_size_invariant)


def hf_train_job(tiny: TinyHF, train):
    """The tiny model and its dataset, as the engines train them."""
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from baige_ray.models.token_dataset import TokenDataset

    return TrainJob(model=HFModel(tiny.model_dir, seq_len=SEQ_LEN), train=train, data=TokenDataset.open(tiny.dataset_dir))


def elastic_hf_run(name: str, storage_path, tiny: TinyHF, *, num_workers: int, num_steps: int, elastic,
                   global_batch_size: int = 24, learning_rate: float = 3e-3, faults=None, layout=None,
                   world_size_invariant: bool = False):
    """The tiny model as an elastic job (elastic_hf_train; pure data parallel unless `layout` says
    otherwise); returns the TrainingJob."""
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.jobs.launch import launch

    job = hf_train_job(tiny, elastic_hf_train(num_steps, global_batch_size=global_batch_size,
                                              learning_rate=learning_rate, world_size_invariant=world_size_invariant))
    return launch(
        job.model,
        data=job.data,
        train=job.train,
        scaling=ScalingConfig(num_workers=num_workers, placement_timeout_s=240),
        run=RunConfig(name=name, storage_path=storage_path, show_progress=False),
        elastic=elastic,
        faults=faults,
        layout=layout,
    )


def save_random_adapter(base: Path, directory: Path, *, seed: int = 3, std: float = 0.5, r: int = 4) -> Path:
    """A PEFT adapter of `base` (rank `r` on q_proj and down_proj) whose B matrices are random, not zero (an
    untrained adapter changes nothing), saved as peft saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "down_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=std)
    peft_model.save_pretrained(directory)
    return Path(directory)


def save_job_adapter(job, adapter, directory: Path, base: Path) -> None:
    """The running LoRA job's newest adapter saved as a PEFT directory (what a replica should serve)."""
    import ray

    from baige_ray.models.adapters import save_adapter
    from baige_ray.parallel.packed_tensors import state_tensors

    save_adapter(directory, state_tensors(ray.get(job.latest_model_state()[1])), adapter, str(base))


def peft_greedy_text(base: Path, adapter_dir: Path, prompt: list[int], tokenizer, new_tokens: int = 8) -> str:
    """peft + transformers' greedy continuation of `prompt` with the adapter, decoded as a server answers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir).eval()
    expected = tuned.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False)
    return tokenizer.decode(expected[0, len(prompt):], skip_special_tokens=True).rstrip("\ufffd")  # as served


CHAT_TEMPLATES = Path(__file__).parent / "unit" / "fixtures" / "chat_templates"
_WORDS = "the model reads a list of numbers and returns their sum or product in order".split()


def write_conversations(path: Path, count: int, *, seed: int = 0, max_turns: int = 3) -> Path:
    """`count` conversations in OpenAI's `messages` shape (.jsonl) of one to `max_turns` exchanges, replies
    of 1 to 12 words: sequences that train unequal numbers of tokens."""
    import json
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = []
        for _ in range(rng.randint(1, max_turns)):
            messages.append({"role": "user", "content": " ".join(rng.choices(_WORDS, k=rng.randint(1, 4)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(_WORDS, k=rng.randint(1, 12)))})
        rows.append({"messages": messages})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# The special tokens each published template writes (a chat model's tokenizer holds each as one token).
CHAT_SPECIAL_TOKENS = {"llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                       "qwen2.5": ["<|im_start|>", "<|im_end|>"], "mistral": []}


def give_chat_template(model_dir: Path, family: str = "llama3") -> str:
    """Save one of the published templates (unit/fixtures/chat_templates) as the tokenizer's own, with the
    special tokens it writes, as a chat model's directory holds them (the model needs a vocabulary of
    VOCAB_SIZE + len(CHAT_SPECIAL_TOKENS[family])); returns the template."""
    from transformers import AutoTokenizer

    template = (CHAT_TEMPLATES / f"{family}.jinja").read_text()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": CHAT_SPECIAL_TOKENS[family]})
    tokenizer.chat_template = template
    tokenizer.save_pretrained(model_dir)
    return template


def build_chat_data(root: Path, *, count: int, seq_len: int, max_turns: int = 2, **build_options):
    """A tiny Llama whose tokenizer holds Llama 3's chat tokens and template, and `count` conversations of it
    built into a ConversationDataset of `seq_len` (packed unless `build_options` say otherwise): (TinyHF,
    the .jsonl of rows, the dataset)."""
    from baige_ray.models.conversation_dataset import ConversationDataset

    tiny = build_tiny_hf(root, vocab_size=VOCAB_SIZE + len(CHAT_SPECIAL_TOKENS["llama3"]))
    give_chat_template(tiny.model_dir)
    rows = write_conversations(root / "conversations.jsonl", count, max_turns=max_turns)
    dataset = ConversationDataset.build(rows, tokenizer=tiny.model_dir, seq_len=seq_len, directory=root / "data",
                                        **build_options)
    return tiny, rows, dataset
