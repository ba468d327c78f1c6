"""Loading a final model checkpoint as the model it holds (its format: checkpoint/final.py).

A Hugging Face model's final checkpoint is a `save_pretrained`-style directory with the same manifest
(models/hf/export.py); a Hugging Face directory without one loads as well.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from baige_ray.api.errors import CheckpointError
from baige_ray.checkpoint.final import MANIFEST_FILE, load_model_state
from baige_ray.models.plugin import config_type_named, plugin_for


def load_checkpoint(directory: Path) -> tuple[int, dict[str, torch.Tensor], Any]:
    """(step, weights by canonical name, model config) of a final checkpoint or a Hugging Face directory."""
    from baige_ray.models.hf.export import is_hf_directory

    directory = Path(directory)
    if is_hf_directory(directory):
        return _load_hf_directory(directory)
    state, manifest = load_model_state(directory)
    if "model_class" not in manifest:
        raise CheckpointError(f"{directory}'s manifest names no model_class: which model it holds is unknown")
    config_type = config_type_named(manifest["model_class"])
    return int(manifest["step"]), state, config_type(**manifest["model_config"])


def _load_hf_directory(directory: Path) -> tuple[int, dict[str, torch.Tensor], Any]:
    from baige_ray.models.hf.model import HFModel

    if (directory / MANIFEST_FILE).is_file():
        state, manifest = load_model_state(directory)
        return int(manifest["step"]), state, HFModel(directory, seq_len=manifest.get("seq_len"))
    model = HFModel(directory)
    return -1, plugin_for(model).read_directory_weights(), model


def load_model(directory: Path) -> nn.Module:
    """The model saved in `directory` (a final checkpoint or a Hugging Face directory), verified, in eval mode."""
    _, weights, config = load_checkpoint(directory)
    return plugin_for(config).build_inference_model(weights)
