"""Read named tensors from safetensors files without loading whole shards (and without unpickling)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from baige_ray.api.errors import CheckpointError


def read_tensors(files: Sequence[Path], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """`names` from whichever of `files` holds them, as float32 CPU tensors; CheckpointError if any is missing
    or a file is corrupt."""
    return dict(iter_tensors(files, names))


def iter_tensors(files: Sequence[Path], names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """`read_tensors` one tensor at a time, so a caller copying each into place holds one, not all."""
    from safetensors import SafetensorError, safe_open

    wanted, found = set(names), set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in sorted(wanted.intersection(handle.keys())):
                    found.add(name)
                    yield name, handle.get_tensor(name).to(torch.float32)
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{path} cannot be read as safetensors ({error}): the file is corrupt") from None
    missing = sorted(wanted - found)
    if missing:
        raise CheckpointError(f"the checkpoint in {files[0].parent} lacks {len(missing)} tensors, e.g. {missing[:3]}")
