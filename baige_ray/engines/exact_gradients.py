"""Gradients summed exactly, so that a step's update is the same bits at any data-parallel size.

Floating-point addition is not associative. DDP's all-reduce adds the replicas' gradients in an order set
by how many replicas there are, and each replica's backward adds its samples in an order set by how many
it holds. An elastic job that shrinks from three workers to two therefore trains other bits than a run
that never shrank. Adam carries the difference forward and chaos grows it: a 30-minute soak ended 1.4e-2
apart in loss after one resize.

With `TrainConfig.world_size_invariant` the global batch is cut into fixed shards, the micro-batches of
`TrainConfig.micro_batch_size`, and each shard's gradient is computed on its own. The shards' gradients
are then summed in fixed point. Each tensor is scaled by one power of two, agreed over all ranks from
its largest element in the whole batch, and rounded to int64. Integer addition is associative, so
neither a rank's own sum nor the all-reduce depends on the order, or on how the shards are spread over
the ranks. The sum goes back to fp32 as each rank's gradient.

An element keeps every bit fp32 gave it when it is within 2^-(38 - log2(shards)) of its tensor's
largest element; smaller ones are rounded to that resolution, the same way whatever the world size.

The cost is that every local shard's gradient is held until the step's reduction, one small all-reduce
(MAX over one number per tensor) and an int64 all-reduce (twice fp32's bytes). Nothing overlaps the
backward as DDP's buckets do.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from baige_ray.api.configs import TrainConfig
from baige_ray.parallel.distributed import all_reduce_abortable
from baige_ray.parallel.layout import ParallelLayout

MAGNITUDE_BITS = 62  # of int64's 63: the sum of every shard's rounded values stays below 2^62
NO_GRADIENT = -1.0  # a tensor's "largest element" where no shard gave it a gradient


def check_world_size_invariant(train: TrainConfig, layout: ParallelLayout, own_engine: str | None = None) -> None:
    """Refuse layouts the exact sum does not cover: it replaces DDP's reduction and nothing else."""
    if not train.world_size_invariant:
        return
    data_parallel_ok = layout.dp == 1 or layout.data_parallel == "ddp"
    if (own_engine is not None or not data_parallel_ok or layout.tp > 1 or layout.pp > 1 or layout.ep > 1
            or layout.cp > 1):
        raise ValueError(
            f"TrainConfig.world_size_invariant=True is invalid with layout {layout.describe()}: expected data "
            "parallelism by DDP without tensor, pipeline, expert or context parallelism (layout='ddp'), on the "
            "torch engine"
        )


class ExactGradientSum:
    """Holds each shard's gradients as its backward ends; `reduce` writes their exact sum over every
    rank of `group` into the parameters' `.grad`."""

    def __init__(self, parameters: list[nn.Parameter], total_shards: int, group: dist.ProcessGroup | None):
        if total_shards < 1:
            raise ValueError(f"total_shards={total_shards} is invalid: expected at least 1")
        self.parameters = parameters
        self.group = group
        self.device = parameters[0].device if parameters else torch.device("cpu")
        self.shard_bits = math.ceil(math.log2(total_shards))
        self._held: list[list[torch.Tensor | None]] = []

    def take_shard(self) -> None:
        """After one shard's backward: its gradients move here and the parameters' `.grad` is cleared."""
        self._held.append([param.grad for param in self.parameters])
        for param in self.parameters:
            param.grad = None

    def reduce(self) -> None:
        held, self._held = self._held, []
        largest = largest_elements(held, len(self.parameters), self.device)
        if self.group is not None:
            all_reduce_abortable(largest, self.group, op=dist.ReduceOp.MAX)
        lowest_bits = lowest_bit_exponents(largest, self.shard_bits)
        present = [index for index, value in enumerate(largest.tolist()) if value != NO_GRADIENT]
        sums = [fixed_point_sum([shard[index] for shard in held], lowest_bits[index], self.parameters[index])
                for index in present]
        flat = torch.cat([total.flatten() for total in sums]) if sums else torch.zeros(0, dtype=torch.int64,
                                                                                         device=self.device)
        if self.group is not None:
            all_reduce_abortable(flat, self.group)
        offset = 0
        for index, total in zip(present, sums):
            param = self.parameters[index]
            part = flat[offset:offset + total.numel()].view_as(total)
            offset += total.numel()
            param.grad = from_fixed_point(part, lowest_bits[index], largest[index], param.dtype)


def largest_elements(held: list[list[torch.Tensor | None]], count: int, device: torch.device) -> torch.Tensor:
    """Per parameter, the largest |element| of its gradient over the held shards (fp64); NO_GRADIENT where
    none has one; +inf where one is not finite (inf survives the MAX all-reduce, NaN might not)."""
    largest = torch.full((count,), NO_GRADIENT, dtype=torch.float64, device=device)
    for shard in held:
        for index, grad in enumerate(shard):
            if grad is None:
                continue
            value = grad.detach().abs().max().double() if grad.numel() else largest.new_zeros(())
            value = torch.where(torch.isnan(value), torch.inf, value)
            largest[index] = torch.maximum(largest[index], value)
    return largest


def lowest_bit_exponents(largest: torch.Tensor, shard_bits: int) -> list[int]:
    """Per parameter, the power of two one integer unit stands for: the largest element is below 2^e
    (frexp), and up to 2^shard_bits shards of values below 2^(MAGNITUDE_BITS - shard_bits) units add up
    below 2^MAGNITUDE_BITS."""
    finite = torch.where(torch.isfinite(largest), largest, torch.zeros_like(largest))
    _, exponents = torch.frexp(finite)
    return [int(e) - (MAGNITUDE_BITS - shard_bits) for e in exponents.tolist()]


def fixed_point_sum(grads: list[torch.Tensor | None], lowest_bit: int, param: torch.Tensor) -> torch.Tensor:
    """The shards' gradients in units of 2^lowest_bit, rounded to the nearest (ties to even), summed as int64
    (zeros where this rank's shards gave none). Scaling fp32 values by a power of two in fp64 is exact, so
    only the rounding to units loses bits."""
    scale = math.ldexp(1.0, -lowest_bit)
    total = torch.zeros(param.shape, dtype=torch.int64, device=param.device)
    for grad in grads:
        if grad is None:
            continue
        units = torch.round(torch.nan_to_num(grad.detach().double(), nan=0.0, posinf=0.0, neginf=0.0) * scale)
        total.add_(units.to(torch.int64))
    return total


def from_fixed_point(units: torch.Tensor, lowest_bit: int, largest: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The summed units back in `dtype`; NaN everywhere where some shard's gradient was not finite (the
    step is spoiled, as plain fp32 addition would have made it)."""
    if not torch.isfinite(largest):
        return torch.full(units.shape, torch.nan, dtype=dtype, device=units.device)
    return (units.double() * math.ldexp(1.0, lowest_bit)).to(dtype)
