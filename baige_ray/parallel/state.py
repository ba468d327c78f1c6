"""Engine state in one canonical, layout-independent form.

Canonical state: {"model": {name: full tensor}, "optimizer": {name: {"step",
"exp_avg", "exp_avg_sq"}}}: full (unsharded) CPU tensors keyed by the model's own
parameter names (a Hugging Face model's are its checkpoint's), whatever the DP/TP/PP layout
that produced them. Export
is collective over sharded tensors (every rank calls it); import needs no
communication: each rank cuts its own shard from the full tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from baige_ray.parallel.boxes import box_of, is_dtensor, piece_of

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
CanonicalState = dict[str, dict]


def full_tensor(tensor: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A full CPU copy of `tensor`; written into `into` when it fits (no fresh allocation per snapshot)."""
    full = tensor.full_tensor() if is_dtensor(tensor) else tensor
    if into is not None and into.shape == full.shape and into.dtype == full.dtype:
        return into.copy_(full.detach())
    return full.detach().cpu().clone()


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters training changes, by name: all of them, but a frozen base under an adapter, which
    every worker reads from the model's directory and no state needs to carry."""
    return [(name, param) for name, param in module.named_parameters() if param.requires_grad]


def export_module_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, into: CanonicalState | None = None
) -> CanonicalState:
    """Full copies of the weights and Adam state; `into`, an earlier export of the same names, is reused."""
    old_model, old_adam = (into or {}).get("model", {}), (into or {}).get("optimizer", {})
    model, adam = {}, {}
    for name, param in trainable_parameters(module):
        model[name] = full_tensor(param, old_model.get(name))
        state = optimizer.state.get(param)
        if state:
            old = old_adam.get(name, {})
            adam[name] = {"step": full_tensor(state["step"], old.get("step"))}
            adam[name].update({key: full_tensor(state[key], old.get(key)) for key in ADAM_KEYS})
    return {"model": model, "optimizer": adam}


def import_module_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: CanonicalState, canonical: Callable[[str], str] = str,
) -> None:
    """Load `state` into the module's parameters and Adam, each rank taking only the box of each tensor it
    keeps (a sharded snapshot's pieces are never assembled whole). `canonical` maps the module's names
    to the state's."""
    model, adam = state["model"], state["optimizer"]
    names = {name: canonical(name) for name, _ in trainable_parameters(module)}
    missing = [key for key in names.values() if key not in model]
    if missing:
        raise KeyError(f"canonical state lacks parameters {missing[:5]}")
    with torch.no_grad():
        for name, param in trainable_parameters(module):
            box = box_of(param)
            _local(param).copy_(piece_of(model, names[name], box).reshape(box.size))
            if names[name] in adam:
                saved = piece_of(adam, names[name], box)
                optimizer.state[param] = {"step": saved["step"].clone()}
                optimizer.state[param].update({key: _local_copy(param, saved[key]) for key in ADAM_KEYS})


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _local_copy(like: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """A tensor laid out as `like` (the same DTensor placements) whose local part is `piece`."""
    made = torch.empty_like(like, requires_grad=False)
    _local(made).copy_(piece.reshape(_local(made).shape))
    return made


def merge_states(parts: list[CanonicalState]) -> CanonicalState:
    """Union of the parts each rank owns (pipeline stages); replicas of a name are identical."""
    merged: CanonicalState = {"model": {}, "optimizer": {}}
    for part in parts:
        for section in ("model", "optimizer"):
            for name, value in part.get(section, {}).items():
                merged[section].setdefault(name, value)
    return merged


def merge_weights(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Union of the weights each rank owns (one part per rank, empty on ranks that keep none)."""
    return merge_states([{"model": part} for part in parts])["model"]
