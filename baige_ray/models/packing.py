"""Packing documents into fixed-length sequences without letting them see each other.

Best-fit decreasing (the bin-packing heuristic TRL's "bfd" packing and LLaMA-Factory's neat packing use):
documents longest first, each into the sequence whose free space it fills most tightly, a new sequence
where none has room. Each sequence then carries every token's position in its own document, restarting
at 0: the model's rotary embeddings follow them, and its attention masks (transformers derives them from
the restarts) keep each token inside its document, so a document scores as it would alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity`, each bin's indices ascending, bins in
    order of their first index. Every length must be 1..capacity."""
    if any(not 0 < length <= capacity for length in lengths):
        raise ValueError(f"best_fit_decreasing: every length must be in 1..{capacity}")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin), ascending: the tightest fit is the first with room
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        slot = bisect.bisect_left(free, (length, -1))
        if slot == len(free):
            bins.append([index])
            bisect.insort(free, (capacity - length, len(bins) - 1))
            continue
        space, chosen = free.pop(slot)
        bins[chosen].append(index)
        bisect.insort(free, (space - length, chosen))
    return sorted((sorted(members) for members in bins), key=lambda members: members[0])


def restarting_positions(lengths: Sequence[int]) -> np.ndarray:
    """0..n-1 for each document of `lengths`, concatenated."""
    total = int(sum(lengths))
    starts = np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)
    return np.arange(total) - starts
