"""Engine state in one canonical, layout-independent form.

Canonical state: {"model": {name: full tensor}, "optimizer": {name: {"step",
"exp_avg", "exp_avg_sq"}}}: full (unsharded) CPU tensors keyed by the model's own
parameter names (a Hugging Face model's are its checkpoint's), whatever the DP/TP/PP layout
that produced them. Export
is collective over sharded tensors (every rank calls it); import needs no
communication: each rank cuts its own shard from the full tensor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
CanonicalState = dict[str, dict]


def full_tensor(tensor: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A full CPU copy of `tensor`; written into `into` when it fits (no fresh allocation per snapshot)."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    if into is not None and into.shape == full.shape and into.dtype == full.dtype:
        return into.copy_(full.detach())
    return full.detach().cpu().clone()


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` is: the same DTensor placements, or a plain tensor on its device."""
    if isinstance(like, DTensor):
        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return full.to(like.device).clone()


def export_module_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, into: CanonicalState | None = None
) -> CanonicalState:
    """Full copies of the weights and Adam state; `into`, an earlier export of the same names, is reused."""
    old_model, old_adam = (into or {}).get("model", {}), (into or {}).get("optimizer", {})
    model, adam = {}, {}
    for name, param in module.named_parameters():
        model[name] = full_tensor(param, old_model.get(name))
        state = optimizer.state.get(param)
        if state:
            old = old_adam.get(name, {})
            adam[name] = {"step": full_tensor(state["step"], old.get("step"))}
            adam[name].update({key: full_tensor(state[key], old.get(key)) for key in ADAM_KEYS})
    return {"model": model, "optimizer": adam}


def import_module_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: CanonicalState) -> None:
    missing = [name for name, _ in module.named_parameters() if name not in state["model"]]
    if missing:
        raise KeyError(f"canonical state lacks parameters {missing[:5]}")
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(shard_like(state["model"][name], param))
            saved = state["optimizer"].get(name)
            if saved is not None:
                optimizer.state[param] = {"step": saved["step"].clone()}
                optimizer.state[param].update({key: shard_like(saved[key], param) for key in ADAM_KEYS})


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
