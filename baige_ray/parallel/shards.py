"""One rank's own pieces of the canonical state, and the canonical state assembled from every rank's.

A sharded engine (FSDP2, ZeRO-3) holds 1/dp of each tensor. Gathering the full state on every rank to
snapshot it costs a collective in step order and dp full copies where one would do; instead each rank
copies only its pieces, with no communication, and records where each piece sits in its full tensor
(a `Box`). Whoever restores assembles the full tensors from the pieces of every rank of a stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from baige_ray.parallel.boxes import Box, Pieces, box_of, is_dtensor, piece_of
from baige_ray.parallel.packed_tensors import PackedTensors, pack_tensors
from baige_ray.parallel.state import ADAM_KEYS, CanonicalState


@dataclass
class ShardedPart:
    """One rank's pieces: `state` is canonical in form (names, sections) but each tensor is the piece
    `boxes[name]` of its full tensor; the Adam moments of a parameter share its box."""

    state: CanonicalState
    boxes: dict[str, Box]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.state))

    def __reduce__(self):
        # To another process as byte arrays, each its tensor's own bytes. A shelf's tensors are views of
        # one mapped file, and torch pickles a view with its whole storage: a 7 MB shelf of 90 tensors
        # became 720 MB of pickle, written on the reading worker's control thread, which then missed
        # heartbeats for seconds and was taken for frozen in the middle of a recovery.
        return _unpack_part, (pack_tensors(dict(_named_tensors(self.state))), self.boxes)


def _named_tensors(state: CanonicalState):
    """((section, name[, key]) joined by NUL, tensor) for every tensor of `state`."""
    for section, values in state.items():
        for name, value in values.items():
            if isinstance(value, dict):
                for key, tensor in value.items():
                    yield "\0".join((section, name, key)), tensor
            else:
                yield "\0".join((section, name)), value


def _unpack_part(packed: PackedTensors, boxes: dict[str, Box]) -> ShardedPart:
    state: CanonicalState = {"model": {}, "optimizer": {}}
    for joined, tensor in packed.tensors(copy=True).items():
        section, name, *key = joined.split("\0")
        if key:
            state.setdefault(section, {}).setdefault(name, {})[key[0]] = tensor
        else:
            state.setdefault(section, {})[name] = tensor
    return ShardedPart(state, boxes)


def assemble(parts: Iterable[CanonicalState | ShardedPart]) -> CanonicalState:
    """The canonical state of the parts' union: whole parts as they are, pieces written into full tensors.

    Raises ValueError when the pieces of a tensor do not cover it (a rank's part is missing)."""
    lazy = assemble_lazily(parts)
    return {"model": dict(lazy["model"]), "optimizer": dict(lazy["optimizer"])}


def assemble_lazily(parts: Iterable[CanonicalState | ShardedPart]) -> CanonicalState:
    """`assemble`, but each full tensor is built when it is looked up and not kept: importing a state
    one tensor at a time then holds one full tensor beside the parts, not the whole state twice."""
    whole: CanonicalState = {"model": {}, "optimizer": {}}
    sharded: list[ShardedPart] = []
    for part in parts:
        if isinstance(part, ShardedPart):
            sharded.append(part)
            continue
        for section in ("model", "optimizer"):
            for name, value in part.get(section, {}).items():
                whole[section].setdefault(name, value)
    pieces = {name: boxes for name, boxes in _pieces_by_name(sharded).items() if name not in whole["model"]}
    for name, boxes in pieces.items():
        _require_cover(name, [box for box, _ in boxes])
    adam = {name: with_adam for name, boxes in pieces.items()
            if (with_adam := [(box, state) for box, state in boxes if name in state["optimizer"]])}
    return {"model": _Assembled(whole["model"], pieces, _weight), "optimizer": _Assembled(whole["optimizer"], adam, _moments)}


class _Assembled(Pieces):
    """Whole tensors as given, and tensors filled from pieces on every lookup: whole ones by name, one
    rank's box by `piece` (what a sharded engine keeps, built without the rest)."""

    def __init__(self, whole: dict, pieces: dict[str, list[tuple[Box, CanonicalState]]], fill):
        self._whole, self._pieces, self._fill = whole, pieces, fill

    def __getitem__(self, name: str):
        if name in self._whole:
            return self._whole[name]
        if name not in self._pieces:
            raise KeyError(name)
        return self._fill(name, self._pieces[name], None)

    def piece(self, name: str, box: Box):
        if name in self._whole:
            return piece_of(self._whole, name, box)
        if name not in self._pieces:
            raise KeyError(name)
        return self._fill(name, self._pieces[name], box)

    def __contains__(self, name: object) -> bool:
        # Mapping's own __contains__ looks the key up, which here would build the full tensor.
        return name in self._whole or name in self._pieces

    def __iter__(self):
        yield from self._whole
        yield from self._pieces

    def __len__(self) -> int:
        return len(self._whole) + len(self._pieces)


def _weight(name: str, boxes: list[tuple[Box, CanonicalState]], target: Box | None) -> torch.Tensor:
    return _fill(boxes, lambda state: state["model"][name], target)


def _moments(name: str, boxes: list[tuple[Box, CanonicalState]], target: Box | None) -> dict[str, torch.Tensor]:
    moments = {"step": boxes[0][1]["optimizer"][name]["step"].clone()}
    moments.update({key: _fill(boxes, lambda state, key=key: state["optimizer"][name][key], target)
                    for key in ADAM_KEYS})
    return moments


def _pieces_by_name(parts: list[ShardedPart]) -> dict[str, list[tuple[Box, CanonicalState]]]:
    """Each name's distinct boxes with the state holding them (replicated boxes are taken once)."""
    found: dict[str, dict[tuple, tuple[Box, CanonicalState]]] = {}
    for part in parts:
        for name, box in part.boxes.items():
            found.setdefault(name, {}).setdefault((box.start, box.size), (box, part.state))
    return {name: list(boxes.values()) for name, boxes in found.items()}


def _require_cover(name: str, boxes: list[Box]) -> None:
    covered = sum(box.volume for box in boxes)
    needed = math.prod(boxes[0].shape)
    if covered != needed:
        raise ValueError(f"the pieces of {name!r} cover {covered} of its {needed} elements: a rank's part is missing")


def _fill(boxes: list[tuple[Box, CanonicalState]], pick, target: Box | None = None) -> torch.Tensor:
    """The full tensor from its pieces, or only its `target` box: the piece itself when a rank kept
    exactly that box, else the overlaps of the pieces with it."""
    if target is not None:
        same = next((state for box, state in boxes if (box.start, box.size, box.flat) ==
                     (target.start, target.size, target.flat)), None)
        if same is not None:
            return pick(same)
        if target.flat or any(box.flat for box, _ in boxes):  # flat and shaped boxes do not intersect simply
            return target.read(_fill(boxes, pick)).clone()
        return _fill_box(boxes, pick, target)
    first_box, first_state = boxes[0]
    full = torch.empty(first_box.shape, dtype=pick(first_state).dtype)
    for box, state in boxes:
        box.write(full, pick(state))
    return full


def _fill_box(boxes: list[tuple[Box, CanonicalState]], pick, target: Box) -> torch.Tensor:
    out = torch.empty(target.size, dtype=pick(boxes[0][1]).dtype)
    covered = 0
    for box, state in boxes:
        shared = target.overlap(box)
        if shared is not None:
            shared.relative_to(target).write(out, shared.relative_to(box).read(pick(state)))
            covered += shared.volume
    if covered != target.volume:
        raise ValueError(f"the pieces cover {covered} of the {target.volume} elements asked for")
    return out


def _tensors(state: CanonicalState):
    for section in state.values():
        for value in section.values():
            if isinstance(value, dict):
                yield from value.values()
            else:
                yield value


@dataclass
class ShardCopy:
    """How a sharded engine's snapshot is taken: `layout()` gives the part's shapes and dtypes (meta
    tensors, nothing copied) so its buffers can be laid out before the first copy; `copy(into)` copies."""

    layout: Callable[[], ShardedPart]
    copy: Callable[[ShardedPart | None], ShardedPart]

    def __call__(self, into: ShardedPart | None = None) -> ShardedPart:
        return self.copy(into)


def meta_part(part_state: CanonicalState, boxes: dict[str, Box]) -> ShardedPart:
    """A part of meta tensors shaped as `part_state`'s (given as tensors or as the DTensors they are pieces of)."""
    def meta(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        return torch.empty(local.shape, dtype=local.dtype, device="meta")

    return ShardedPart({"model": {name: meta(t) for name, t in part_state["model"].items()},
                        "optimizer": {name: {key: meta(t) for key, t in adam.items()}
                                      for name, adam in part_state["optimizer"].items()}}, dict(boxes))


@dataclass
class LocalSources:
    """This rank's sharded tensors by canonical name, looked up on the training thread: FSDP2 swaps the
    unsharded parameters into the module during forward and backward, so a copy running beside the next
    step must not look the parameters up itself."""

    params: dict[str, torch.Tensor]
    adam: dict[str, dict[str, torch.Tensor]]

    @classmethod
    def of(cls, module: nn.Module, optimizer: torch.optim.Optimizer) -> LocalSources:
        params = {name: param for name, param in module.named_parameters() if param.requires_grad}  # not a frozen base
        adam = {name: {key: state[key] for key in ("step", *ADAM_KEYS)}
                for name, param in params.items() if (state := optimizer.state.get(param))}
        return cls(params, adam)

    def layout(self) -> ShardedPart:
        return meta_part({"model": self.params, "optimizer": self.adam},
                         {name: box_of(param) for name, param in self.params.items()})

    def copy(self, into: ShardedPart | None = None) -> ShardedPart:
        """This rank's pieces of the weights and Adam state, copied without communication; `into`, an
        earlier part of the same names, is written over instead of allocating."""
        old_model = into.state["model"] if into is not None else {}
        old_adam = into.state["optimizer"] if into is not None else {}
        model = {name: copy_local(param, old_model.get(name)) for name, param in self.params.items()}
        adam = {name: {key: copy_local(value, old_adam.get(name, {}).get(key)) for key, value in state.items()}
                for name, state in self.adam.items()}
        return ShardedPart({"model": model, "optimizer": adam},
                           {name: box_of(param) for name, param in self.params.items()})


def copy_local(tensor: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A CPU copy of this rank's piece of `tensor`, written into `into` when it fits."""
    local = (tensor.to_local() if is_dtensor(tensor) else tensor).detach()
    if into is not None and into.shape == local.shape and into.dtype == local.dtype:
        return into.copy_(local)
    return local.cpu().clone()
