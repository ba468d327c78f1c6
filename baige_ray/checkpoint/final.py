"""A final model checkpoint's format: weights plus a manifest that commits them.

The weights file is written first and renamed into place; the manifest, which holds its SHA-256 and
size, is written last, so a directory without a valid manifest was never committed. Loading verifies
the checksum before reading anything; safetensors files hold no code, and `.pt` files are unpickled
with `weights_only=True` (tensors and plain containers). Which model the weights belong to is the
model layer's business (runtime/checkpoint_io.py): this module knows the manifest's fields only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from baige_ray.api.errors import CheckpointError
from baige_ray.checkpoint.files import sha256_file, write_atomically

WEIGHTS_FILE = "model.pt"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


def save_model_checkpoint(
    directory: Path, state: dict[str, torch.Tensor], *, model_config: Any, step: int
) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_FILE).unlink(missing_ok=True)
    weights = directory / WEIGHTS_FILE
    write_atomically(weights, lambda handle: torch.save(state, handle))
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "model_class": type(model_config).__name__,
        "model_config": dataclasses.asdict(model_config),
        "weights_sha256": sha256_file(weights),
        "weights_bytes": weights.stat().st_size,
    }
    write_atomically(directory / MANIFEST_FILE, lambda handle: handle.write(json.dumps(manifest, indent=2).encode()))
    return directory


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} has no {MANIFEST_FILE}: the checkpoint was never committed") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}): the checkpoint is corrupted") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version={manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    return manifest


def load_model_state(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    directory = Path(directory)
    manifest = read_manifest(directory)
    weights = directory / manifest.get("weights_file", WEIGHTS_FILE)
    if not weights.is_file():
        raise CheckpointError(f"{weights} is missing")
    size = weights.stat().st_size
    if size != manifest["weights_bytes"]:
        raise CheckpointError(f"{weights} holds {size} bytes, the manifest says {manifest['weights_bytes']}: truncated")
    if sha256_file(weights) != manifest["weights_sha256"]:
        raise CheckpointError(f"{weights} fails its SHA-256 check: the file is corrupted")
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(weights, device="cpu"), manifest
    return torch.load(weights, map_location="cpu", weights_only=True), manifest
