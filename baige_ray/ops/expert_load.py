"""Expert load of one training step: routed slots per expert, summed over ranks, as max / mean.

Each rank reports, per MoE layer it holds, the slots its own tokens routed to each expert (engines'
`take_expert_traffic`). Ranks of one pipeline stage hold the same layers in the same order, so a
layer is (stage, position in the stage's list); its load is the sum over the stage's ranks.
"""

from __future__ import annotations

from collections.abc import Sequence


def expert_load(per_rank_layers: Sequence[Sequence[Sequence[int]]], stage_of_rank: Sequence[int]) -> list[list[int]]:
    """Slots per expert of every MoE layer, summed over the ranks holding it, stages in order."""
    totals: dict[tuple[int, int], list[int]] = {}
    for layers, stage in zip(per_rank_layers, stage_of_rank):
        for position, counts in enumerate(layers):
            if not counts:  # a tensor-parallel rank > 0: its peers counted the same tokens
                continue
            summed = totals.setdefault((stage, position), [0] * len(counts))
            for expert, count in enumerate(counts):
                summed[expert] += count
    return [totals[key] for key in sorted(totals)]


def imbalance(load: Sequence[Sequence[int]]) -> float:
    """max / mean slots per expert of the worst layer (1.0 is perfectly even; 1.0 with no layers)."""
    worst = 1.0
    for counts in load:
        mean = sum(counts) / len(counts)
        if mean > 0:
            worst = max(worst, max(counts) / mean)
    return worst
