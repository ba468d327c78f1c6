"""New weights copied into a built model by name, for engines that keep their model between versions."""

from __future__ import annotations

import torch
from torch import nn


def copy_weights_in_place(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` into `model`'s parameters and buffers of the same names. A name the model lacks, a
    shape it does not have, or a tensor of its left without a value (other than one tied to a given one,
    as a tied LM head is to the embeddings) is refused with a ValueError before anything is copied."""
    own = model.state_dict()
    unknown = sorted(set(weights) - set(own))
    mismatched = sorted(name for name in set(weights) & set(own) if weights[name].shape != own[name].shape)
    given = {own[name].data_ptr() for name in weights if name in own}
    unset = sorted(name for name in set(own) - set(weights) if own[name].data_ptr() not in given)
    if unknown or mismatched or unset:
        raise ValueError(f"the weights do not fit the model: unknown names {unknown[:5]}, other shapes "
                         f"{mismatched[:5]}, missing {unset[:5]}")
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(value)
