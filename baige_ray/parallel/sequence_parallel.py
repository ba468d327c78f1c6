"""Sequence parallelism with tensor parallelism (Korthikanti et al. 2022, sec. 4.2.2), torchtitan's way.

Between the tensor-parallel regions of a block (its norms, its residual stream) each TP rank holds
1/tp of the sequence instead of all of it. A norm runs on the rank's slice (`SequenceParallel`); the
attention and MLP inputs are all-gathered over the sequence as they enter their column-parallel
projections (`PrepareModuleInput`); the row-parallel output projections reduce-scatter over the
sequence (`RowwiseParallel(output_layouts=Shard(1))`) where plain TP all-reduces. A stage's first
block takes its slice of the sequence on entry and its last block gathers it whole again, so what
crosses a stage boundary (the embedding's output, a pipeline send, the final norm and head) is as
without sequence parallelism.

What it saves, as torch runs it: the norms' and the residual stream's activations shrink by tp; the
inputs of the column-parallel projections are still saved whole by their matmuls (Megatron-LM keeps
only the slice and gathers again in backward). planner/memory.py prices exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

SEQUENCE_DIM = 1  # (batch, sequence, hidden) everywhere between blocks


def sequence_parallel_styles(*, norms: Sequence[str], keyword_inputs: dict[str, str] | None = None,
                             positional_inputs: Sequence[str] = ()) -> dict[str, Any]:
    """Block-relative DTensor styles: `norms` run on each rank's slice of the sequence; the sublayers in
    `keyword_inputs` (module name -> the keyword its hidden states come in as) and `positional_inputs`
    gather the sequence whole as they are entered, and hand their insides plain tensors as plain
    tensor parallelism does."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    styles: dict[str, Any] = {name: SequenceParallel(sequence_dim=SEQUENCE_DIM) for name in norms}
    for name, keyword in (keyword_inputs or {}).items():
        styles[name] = PrepareModuleInput(input_kwarg_layouts={keyword: Shard(SEQUENCE_DIM)},
                                          desired_input_kwarg_layouts={keyword: Replicate()}, use_local_output=True)
    for name in positional_inputs:
        styles[name] = PrepareModuleInput(input_layouts=(Shard(SEQUENCE_DIM),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    return styles


def row_parallel_to_sequence_slices():
    """The row-parallel output projection's style under sequence parallelism: its partial sums are
    reduce-scattered over the sequence (each rank keeps its slice) instead of all-reduced."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM))


def split_sequence(hidden: torch.Tensor, tp_mesh) -> torch.Tensor:
    """This rank's slice of a sequence every TP rank holds whole; its backward gathers the slices'
    gradients whole again (each rank's is the gradient of its own slice only)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    length, ranks = hidden.shape[SEQUENCE_DIM], tp_mesh.size()
    if length % ranks:
        raise ValueError(f"sequence parallelism splits each sequence over the tp={ranks} ranks: a sequence of "
                         f"{length} tokens does not split evenly; use a length divisible by {ranks} or "
                         "ParallelLayout(sequence_parallel=False)")
    whole = DTensor.from_local(hidden, tp_mesh, [Replicate()], run_check=False)
    return whole.redistribute(tp_mesh, [Shard(SEQUENCE_DIM)]).to_local()


def gather_sequence(piece: torch.Tensor, tp_mesh) -> torch.Tensor:
    """The whole sequence from every TP rank's slice (an all-gather); its backward keeps the slice of
    the gradient, which is whole and equal on every rank after the replicated computation that follows."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(piece, tp_mesh, [Shard(SEQUENCE_DIM)], run_check=False).redistribute(
        tp_mesh, [Replicate()]).to_local()


def split_sequence_across(blocks: Sequence[nn.Module], tp_mesh) -> None:
    """Make the consecutive `blocks` of one stage pass the sequence between them in slices: the first
    takes its slice as it is entered, the last gathers it whole as it leaves."""
    if not blocks:
        return

    def enter(module: nn.Module, args: tuple) -> tuple:
        return (split_sequence(args[0], tp_mesh), *args[1:])

    def leave(module: nn.Module, args: tuple, output):
        if isinstance(output, tuple):
            return (gather_sequence(output[0], tp_mesh), *output[1:])
        return gather_sequence(output, tp_mesh)

    blocks[0].register_forward_pre_hook(enter)
    blocks[-1].register_forward_hook(leave)
