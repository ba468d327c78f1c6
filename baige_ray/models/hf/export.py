"""Write a trained HFModel as a Hugging Face directory that `from_pretrained` loads, committed by a manifest.

config.json (transformers' own writer), model.safetensors (in transformers' own checkpoint layout:
canonical names are the model's own, with MoE experts written one by one as `save_pretrained`
writes them), the tokenizer's files, then baige's manifest.json with the weights' SHA-256, written last:
a directory without a valid manifest was never committed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from baige_ray.checkpoint.files import sha256_file, write_atomically, write_json_atomically
from baige_ray.models.hf.model import HFModel

WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
FORMAT = "huggingface"


def save_hf_checkpoint(directory: Path, weights: dict[str, torch.Tensor], model: HFModel, *, step: int) -> Path:
    from safetensors.torch import save

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_FILE).unlink(missing_ok=True)
    tensors = {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in weights.items()}
    payload = save(checkpoint_layout(model, tensors), metadata={"format": "pt"})
    write_atomically(directory / WEIGHTS_FILE, lambda handle: handle.write(payload))
    config = model.transformers_config()
    config.architectures = [model.architecture]
    config.save_pretrained(directory)
    if model.tokenizer is not None:
        model.load_tokenizer().save_pretrained(directory)
    manifest = {
        "format_version": 1,
        "format": FORMAT,
        "step": step,
        "weights_file": WEIGHTS_FILE,
        "weights_sha256": sha256_file(directory / WEIGHTS_FILE),
        "weights_bytes": (directory / WEIGHTS_FILE).stat().st_size,
        "seq_len": model.seq_len,
    }
    write_json_atomically(directory / MANIFEST_FILE, manifest)
    return directory


def checkpoint_layout(model: HFModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors under the names and layout transformers' `save_pretrained` writes: the model's
    own, except for mixture-of-experts models, whose checkpoints hold experts one by one."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(model.transformers_config())
    return {name: tensor.contiguous() for name, tensor in revert_weight_conversion(module, tensors).items()}


def is_hf_directory(directory: Path) -> bool:
    """A Hugging Face model directory (ours, with a manifest, or anyone's, without)."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        return False
    manifest = directory / MANIFEST_FILE
    return not manifest.is_file() or json.loads(manifest.read_text()).get("format") == FORMAT
