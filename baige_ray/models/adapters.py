"""LoRA adapters, through `peft`, on the stages a rank trains.

peft injects its LoRA layers into each stage a rank holds (`inject_adapter_in_model`: a target Linear
becomes peft's `lora.Linear`, its weight under `<module>.base_layer`). The base weights are frozen, so
the optimizer, the gradient reductions, snapshots, replicas and the final export see the adapter's
parameters alone (engines and parallel/state.py take trainable parameters only); a replacement worker
reads the base weights from the model's directory, as every worker does.

Each LoRA A matrix is drawn from a generator seeded by the run's seed and the module's name, so every
layout (and one process) starts from the same adapter whichever stages a rank holds. The export is a
PEFT adapter directory: `peft.PeftModel.from_pretrained(base, directory)` loads it.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from peft import LoraConfig

ADAPTER_NAME = "default"  # peft's name for a model's one adapter
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"  # PEFT's file name


def check_adapter(adapter: Any) -> None:
    """ValueError naming the field for an adapter config this project cannot train."""
    try:
        from peft import LoraConfig
    except ImportError as error:  # a dependency, but say what it is for
        raise ValueError("adapter= needs peft (pip install peft)") from error
    if not isinstance(adapter, LoraConfig):
        raise ValueError(f"adapter={adapter!r} is invalid: expected a peft.LoraConfig")
    if adapter.bias != "none":
        raise ValueError(f"LoraConfig.bias={adapter.bias!r} is invalid here: expected 'none' (biases stay frozen)")
    if adapter.modules_to_save:
        raise ValueError(f"LoraConfig.modules_to_save={adapter.modules_to_save!r} is invalid here: expected None "
                         "(only LoRA matrices train)")
    if adapter.use_dora:
        raise ValueError("LoraConfig.use_dora=True is invalid here: expected plain LoRA")


def check_adapter_layout(layout: Any) -> None:
    """ValueError, before any worker starts, for a layout adapters do not train in yet."""
    if layout.tp > 1 or layout.ep > 1:
        raise ValueError(f"layout {layout.describe()} is invalid with adapter=: peft's LoRA layers wrap the Linear "
                         "modules tensor and expert parallelism split; expected tp=1 and ep=1 (data and pipeline "
                         "parallelism)")


def is_adapter_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def add_lora(stages: list[nn.Module], adapter: LoraConfig, seed: int) -> None:
    """Inject `adapter`'s LoRA layers into every stage, freeze everything else, draw each A by its name."""
    import copy

    from peft import inject_adapter_in_model

    for stage in stages:
        inject_adapter_in_model(copy.deepcopy(adapter), stage, adapter_name=ADAPTER_NAME)
        for name, param in stage.named_parameters():
            param.requires_grad_(is_adapter_parameter(name))
        _draw_lora_a(stage, seed)
    if not any(is_adapter_parameter(name) for stage in stages for name, _ in stage.named_parameters()):
        raise ValueError(f"LoraConfig.target_modules={adapter.target_modules!r} matched no module of the model")


def _draw_lora_a(stage: nn.Module, seed: int) -> None:
    """peft's initialisation (A Kaiming-uniform, B zero), A from a generator of its own per module."""
    with torch.no_grad():
        for name, module in stage.named_modules():
            lora_a = getattr(module, "lora_A", None)
            if isinstance(lora_a, nn.ModuleDict) and ADAPTER_NAME in lora_a:
                digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
                generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
                weight = lora_a[ADAPTER_NAME].weight
                drawn = torch.empty(weight.shape, dtype=weight.dtype)
                nn.init.kaiming_uniform_(drawn, a=math.sqrt(5), generator=generator)
                weight.copy_(drawn)
                module.lora_B[ADAPTER_NAME].weight.zero_()


def peft_key(name: str) -> str:
    """The name PEFT saves an adapter tensor under: the PeftModel's prefix, without the adapter's name."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def save_adapter(directory: Path, weights: dict[str, torch.Tensor], adapter: LoraConfig, base_model: str) -> Path:
    """A PEFT adapter directory of `weights` (adapter parameters by canonical name): adapter_config.json
    (peft writes it) and adapter_model.safetensors. Returns its path."""
    import copy

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {peft_key(name): tensor.detach().contiguous().cpu() for name, tensor in weights.items()
               if is_adapter_parameter(name)}
    if not tensors:
        raise ValueError("no adapter weights to save: expected LoRA parameters (lora_A / lora_B)")
    save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = copy.deepcopy(adapter)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(directory))
    return directory


def merge_adapter(adapter_directory: str | Path, directory: str | Path) -> Path:
    """The adapter's base model with the adapter merged into its weights, saved as a Hugging Face directory
    (weights, config and the base's tokenizer) that transformers, vLLM and `br.HFModel` load. peft merges
    (`merge_and_unload`); the base is the directory the adapter names. Returns the directory."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_directory, directory = Path(adapter_directory), Path(directory)
    if not (adapter_directory / "adapter_config.json").is_file():
        raise ValueError(f"{adapter_directory} holds no adapter_config.json: expected a PEFT adapter directory")
    base_path = PeftConfig.from_pretrained(str(adapter_directory)).base_model_name_or_path
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto", trust_remote_code=False)
    merged = PeftModel.from_pretrained(base, str(adapter_directory)).merge_and_unload()
    merged.save_pretrained(directory)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(directory)
    return directory
