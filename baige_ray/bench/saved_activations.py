"""Activation memory as autograd holds it: the bytes of the tensors a forward saves for its backward.

What the planner's activation model (planner/memory.py) prices, measured without an allocator's
statistics (a CPU has none): every tensor saved for backward is counted once by its storage, the local
shard of a DTensor by its own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch


def saved_activation_bytes(forward: Callable[[], Any], exclude: Collection[int] = ()) -> tuple[int, Any]:
    """(bytes of distinct storages `forward` saved for backward, what it returned); storages whose data
    pointer is in `exclude` (the parameters, which a linear layer saves) are not counted."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        output = forward()
    return sum(storages.values()), output
