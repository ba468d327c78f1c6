"""Read named tensors from safetensors files without loading whole shards (and without unpickling)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from baige_ray.api.errors import CheckpointError


def read_tensors(files: Sequence[Path], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """`names` from whichever of `files` holds them, as float32 CPU tensors; CheckpointError if any is missing
    or a file is corrupt."""
    from safetensors import SafetensorError, safe_open

    wanted, found = set(names), {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in wanted.intersection(handle.keys()):
                    found[name] = handle.get_tensor(name).to(torch.float32)
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{path} cannot be read as safetensors ({error}): the file is corrupt") from None
    missing = sorted(wanted - set(found))
    if missing:
        raise CheckpointError(f"the checkpoint in {files[0].parent} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return found
