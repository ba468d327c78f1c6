"""Auxiliary losses computed inside a model's forward (an MoE router's load-balancing loss).

Under pipeline parallelism a layer's auxiliary loss lives on its own stage while the main loss
is on the last one, so it cannot simply be added to the loss the engine backpropagates. A layer
instead attaches it to its output (`attach_auxiliary_loss`): the forward value is unchanged and
the backward pass adds the gradient of `weight x loss`, where `weight` is what the engine gives
the current micro-batch's main loss in the same backward (1 / accumulation count, or 1 when the
pipeline schedule scales gradients afterwards). The engine opens `auxiliary_losses(weight)`
around its forwards and adds the recorded values to the loss it reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch


class AuxiliaryLosses:
    """What the forwards under one `auxiliary_losses` block contributed, grouped by forward pass
    where the engine marks where each begins (`start_forward`)."""

    def __init__(self, weight: float):
        self.weight = weight
        # detached; read once per step (a read syncs an accelerator)
        self.forwards: list[list[torch.Tensor]] = [[]]

    def start_forward(self) -> None:
        self.forwards.append([])

    def record(self, loss: torch.Tensor) -> None:
        self.forwards[-1].append(loss.detach().float())

    @property
    def total(self) -> float:
        """The sum of the recorded losses, unweighted."""
        return self.total_of_last(len(self.forwards))

    def total_of_last(self, num_forwards: int) -> float:
        """The sum over the last `num_forwards` marked forward passes only."""
        values = [value for forward in self.forwards[-num_forwards:] for value in forward]
        return float(torch.stack(values).sum()) if values else 0.0


_active: ContextVar[AuxiliaryLosses | None] = ContextVar("baige_auxiliary_losses", default=None)


@contextmanager
def auxiliary_losses(weight: float = 1.0) -> Iterator[AuxiliaryLosses]:
    collector = AuxiliaryLosses(weight)
    token = _active.set(collector)
    try:
        yield collector
    finally:
        _active.reset(token)


def mark_forward() -> None:
    """Start a new forward pass in the active collector, if any (engines call it from a forward pre-hook)."""
    collector = _active.get()
    if collector is not None:
        collector.start_forward()


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor):
        grad_loss = torch.full(ctx.loss_shape, ctx.weight, dtype=ctx.loss_dtype, device=grad_hidden.device)
        return grad_hidden, grad_loss, None


def attach_auxiliary_loss(hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`hidden`, unchanged, carrying `loss` into the backward pass (outside an engine, with weight 1)."""
    collector = _active.get()
    weight = collector.weight if collector is not None else 1.0
    if collector is not None:
        collector.record(loss)
    return _AttachLoss.apply(hidden, loss, weight)
