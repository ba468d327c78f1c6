"""Writing and reading safetensors files for checkpoints.

Writing streams each tensor's memory straight into the file in the safetensors
format, hashing on the way: `safetensors.torch.save_file` would refuse tensors
that are views of one host buffer (a snapshot's usual layout), copy every tensor
into a Python bytes object first, and leave the SHA-256 to a second read. File
writes and hashing of large buffers release the GIL, so a background writer
barely slows the training thread. Reading uses the safetensors library itself,
which also checks that what was written is valid safetensors; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from baige_ray.api.errors import CheckpointError

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
HEADER_ALIGNMENT = 8


def host_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _encode_header(tensors: dict[str, torch.Tensor]) -> bytes:
    header: dict[str, dict] = {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_CODES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % HEADER_ALIGNMENT)


def write_tensor_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, object]:
    """Write `tensors` (sorted by name) as a safetensors file, fsynced; return its manifest record.

    A helper thread hashes each chunk while this one writes it (hashing and writing
    take about as long, and both release the GIL); its queue runs the updates in order.
    """
    ordered = {name: tensors[name] for name in sorted(tensors)}
    header = _encode_header(ordered)
    chunks = [memoryview(struct.pack("<Q", len(header))), memoryview(header)]
    chunks += [host_bytes(tensor) for tensor in ordered.values()]
    digest = hashlib.sha256()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as hasher:
        with Path(path).open("wb") as handle:
            updates = []
            for chunk in chunks:
                updates.append(hasher.submit(digest.update, chunk))
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
            # Written and durable: its pages need not stay cached at the expense of the training's memory.
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    for update in updates:
        update.result()  # re-raises a failed update rather than recording a wrong hash
    return {"bytes": sum(chunk.nbytes for chunk in chunks), "sha256": digest.hexdigest()}


def read_tensor_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
