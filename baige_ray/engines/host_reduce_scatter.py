"""FSDP2's gradient reduce-scatter on CPU workers (gloo), as `parallelize.apply_fsdp` installs it.

In a module of its own: subclassing FSDP2's `ReduceScatter` imports FSDP2 and DTensor (0.6 s), which a
worker training by DDP never needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from baige_ray.parallel.distributed import all_reduce_abortable


class HostReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter over gloo without fresh memory at every call.

    gloo's reduce-scatter copies its whole input at each call, and FSDP2 allocates that input anew: on a
    CPU worker both are fresh pages above the allocator's 32 MB threshold, faulted in (and zeroed) at every
    step. Here an input, once reduced, goes back to a free list its size draws from, and it is reduced in
    place by an all-reduce whose shard is copied out: the same sums. Outputs are never returned to the list
    (FSDP2 keeps them as the sharded gradients), so a buffer is never handed out twice."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((tuple(int(n) for n in size), dtype, device))
        return free.pop() if free else torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        average = op == dist.ReduceOp.AVG
        all_reduce_abortable(input_tensor, group, op=dist.ReduceOp.SUM if average else op)
        shard = input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
        if average:
            torch.div(shard, dist.get_world_size(group), out=output_tensor.view_as(shard))
        else:
            output_tensor.view_as(shard).copy_(shard)
        key = (tuple(input_tensor.shape), input_tensor.dtype, input_tensor.device)
        self._free.setdefault(key, []).append(input_tensor)
        return None
