"""When a slow worker costs more than it gives: detect persistent stragglers and decide to evict them.

In synchronous data parallelism every step waits for the slowest rank, so a
straggler slows the whole group to its pace. Evicting it pays when the remaining
ranks, at their own pace, process more samples per second than the whole group
at the straggler's pace.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class StragglerObservation:
    compute_s: tuple[tuple[float, ...], ...]  # recent steps, oldest first; per rank forward + backward seconds,
    # each divided by the rank's relative load (`relative_loads`)
    threshold: float  # slower than the median of its peers by this factor
    patience: int  # for this many consecutive steps
    num_spares: int
    min_workers: int
    replica_size: int  # ranks that leave together (tp x pp)
    valid_sizes: tuple[int, ...]
    step_s: float  # the group's recent median step time: compute, communication and all
    min_gain: float = 0.1  # act only when it buys at least this much throughput


class StragglerAction(Enum):
    TOLERATE = "tolerate"
    REPLACE = "replace"
    EVICT = "evict"
    RELEASE = "release"  # a shrink asked for by someone else (a lend) lets the straggler go first


@dataclass(frozen=True)
class StragglerDecision:
    action: StragglerAction
    rank: int | None
    reason: str


def relative_loads(shares: Sequence[float], speeds: Sequence[float]) -> tuple[float, ...]:
    """Each rank's expected compute time relative to the group's mean: its share of the batch over its
    chip's speed. Compute times divided by these are paces the ranks can be compared by: a rank holding
    two micro-batches where its peers hold one is not a straggler for taking twice as long (a 3-minute
    soak on 3 workers evicted the rank holding the batch's extra micro-batch five times), and a slower
    chip given less work is not one for matching its peers."""
    expected = [share / speed for share, speed in zip(shares, speeds, strict=True)]
    mean = sum(expected) / len(expected)
    return tuple(load / mean for load in expected)


def persistent_straggler(compute_s: tuple[tuple[float, ...], ...], threshold: float, patience: int) -> int | None:
    """The rank that was the slow outlier in each of the last `patience` steps, if one was. In each, not in
    most: with four workers on two shared cores, a rank slow in 3 of 5 steps by chance alone is common (a
    rule on medians over 5 steps evicted a healthy worker every 7-10 s there)."""
    if len(compute_s) < patience:
        return None
    suspects = {_outlier(step, threshold) for step in compute_s[-patience:]}
    if len(suspects) == 1 and None not in suspects:
        return suspects.pop()
    return None


def window_pace(compute_s: tuple[tuple[float, ...], ...], patience: int) -> tuple[float, ...] | None:
    """Each rank's median compute seconds over the last `patience` steps (None before there are that many):
    what a straggler is priced at, rather than its last step alone."""
    window = compute_s[-patience:]
    if len(compute_s) < patience or len({len(step) for step in window}) != 1:
        return None
    return tuple(statistics.median(step[rank] for step in window) for rank in range(len(window[0])))


def slow_ranks(compute_s: tuple[tuple[float, ...], ...], threshold: float, patience: int) -> tuple[int, ...]:
    """Ranks whose median compute over the last `patience` steps exceeds `threshold` x the median of every
    rank's, slowest first: those a shrink should release before any other.

    Softer than `persistent_straggler`: a shrink releases someone anyway, so choosing a slow rank costs
    nothing even where evicting it alone would not have paid, or patience has not run out yet."""
    pace = window_pace(compute_s, patience)
    if pace is None or len(pace) < 2:
        return ()
    typical = statistics.median(pace)
    return tuple(sorted((rank for rank, t in enumerate(pace) if t > threshold * typical), key=lambda r: -pace[r]))


def _outlier(per_rank: tuple[float, ...], threshold: float) -> int | None:
    if len(per_rank) < 2:
        return None
    slowest = max(range(len(per_rank)), key=per_rank.__getitem__)
    peers = [t for rank, t in enumerate(per_rank) if rank != slowest]
    return slowest if per_rank[slowest] > threshold * statistics.median(peers) else None


def decide_straggler(obs: StragglerObservation) -> StragglerDecision:
    rank = persistent_straggler(obs.compute_s, obs.threshold, obs.patience)
    if rank is None:
        return StragglerDecision(StragglerAction.TOLERATE, None, "no persistent straggler")
    pace = window_pace(obs.compute_s, obs.patience) or obs.compute_s[-1]
    slow, fast = pace[rank], statistics.median(t for r, t in enumerate(pace) if r != rank)
    # The step waits for the slowest rank: without it, it would be `excess` shorter.
    excess = min(slow - fast, obs.step_s)
    without = max(obs.step_s - excess, 1e-9)
    if obs.num_spares > 0:
        if obs.step_s / without < 1 + obs.min_gain:
            return StragglerDecision(StragglerAction.TOLERATE, rank, f"rank {rank} costs under {obs.min_gain:.0%} of a step")
        return StragglerDecision(StragglerAction.REPLACE, rank, f"rank {rank} is {slow / fast:.1f}x slower; a spare takes it")
    num_workers = len(pace)
    smaller = [size for size in obs.valid_sizes if size <= num_workers - obs.replica_size]
    shrunk = max(smaller, default=0)
    if shrunk < obs.min_workers or shrunk == 0:
        return StragglerDecision(StragglerAction.TOLERATE, rank, f"rank {rank} is slow but min_workers={obs.min_workers}")
    # Throughput is proportional to workers / step time.
    if shrunk / without > (1 + obs.min_gain) * num_workers / obs.step_s:
        return StragglerDecision(
            StragglerAction.EVICT, rank, f"rank {rank} is {slow / fast:.1f}x slower; {shrunk} workers at full pace do more"
        )
    return StragglerDecision(StragglerAction.TOLERATE, rank, f"rank {rank} is slow, but evicting it would not pay")
