"""Where a rank's piece of a tensor sits in the full tensor, and state that can hand out pieces.

A `Box` names a piece; `Pieces` is a mapping of full tensors that can also give one box of a tensor
without building the whole of it (a state assembled from every rank's snapshot, shards.py), so that
restoring a sharded engine touches only the bytes each rank keeps.
"""

from __future__ import annotations

import math
import sys
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Box:
    """Where a piece sits in its full tensor of `shape`: `start` and `size` per dimension of the index
    space, which is the tensor's own (DTensor shards) or, with `flat`, the flattened tensor (ZeRO-3)."""

    shape: tuple[int, ...]
    start: tuple[int, ...]
    size: tuple[int, ...]
    flat: bool = False

    @classmethod
    def whole(cls, shape) -> Box:
        shape = tuple(shape)
        return cls(shape, (0,) * len(shape), shape)

    @property
    def volume(self) -> int:
        return math.prod(self.size)

    def _index(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.start, self.size))

    def read(self, full: torch.Tensor) -> torch.Tensor:
        """This box of `full` (a view), shaped as the piece is."""
        source = full.reshape(-1) if self.flat else full
        return source[self._index()]

    def write(self, full: torch.Tensor, piece: torch.Tensor) -> None:
        """Copy `piece` into its place in `full` (a tensor of `shape`)."""
        target = full.view(-1) if self.flat else full
        target[self._index()].copy_(piece.reshape(self.size))

    def overlap(self, other: Box) -> Box | None:
        """The part of the index space both boxes cover (both unflattened), None when they do not meet."""
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        end = tuple(min(a + n, b + m) for a, n, b, m in zip(self.start, self.size, other.start, other.size))
        if any(e <= s for s, e in zip(start, end)):
            return None
        return Box(self.shape, start, tuple(e - s for s, e in zip(start, end)))

    def relative_to(self, outer: Box) -> Box:
        """This box's place inside the piece `outer` describes."""
        return Box(outer.size, tuple(s - o for s, o in zip(self.start, outer.start)), self.size)


def is_dtensor(tensor: object) -> bool:
    """Whether `tensor` is a DTensor, without importing DTensor (half a second, most of it sympy) into
    a process that never built one: where the module was never imported, nothing is a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def box_of(tensor: torch.Tensor) -> Box:
    """Where this rank's piece of `tensor` sits: a DTensor's local shard, or the whole of a plain tensor."""
    if is_dtensor(tensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        size, start = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return Box(tuple(tensor.shape), tuple(start), tuple(size))
    return Box.whole(tensor.shape)


class Pieces(Mapping):
    """Full tensors by name that can also hand out one box of a tensor without building all of it."""

    @abstractmethod
    def piece(self, name: str, box: Box):
        """`box` of the value under `name`: a tensor, or for Adam state its moments' boxes and step."""


def piece_of(values: Mapping, name: str, box: Box):
    """`box` of `values[name]`, built alone when `values` can (Pieces); Adam state keeps its step whole."""
    if isinstance(values, Pieces):
        return values.piece(name, box)
    value = values[name]
    if isinstance(value, dict):
        return {key: tensor if key == "step" else box.read(tensor) for key, tensor in value.items()}
    return box.read(value)
