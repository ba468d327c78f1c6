"""Prefix routing policy: which replicas a request should try first (pure, no Ray).

A request whose prompt starts with blocks a replica already holds costs that replica only the rest
of the prefill; on any other replica it costs the whole prompt. So the replica with the longest
cached prefix goes first, unless it is overloaded: when its queue is `overload_margin` or more
requests longer than the shortest queue among the candidates, a recomputed prefill on an idle
replica is cheaper than waiting behind the batch, and the least loaded replicas go first instead.
A request that matches nothing anywhere (a new system prompt, a first turn) also goes to the least
loaded, which spreads new prefixes over the replicas.

A replica that stops (a device lent back to training, a scale-down) hands its hottest blocks to the peer
that holds the fewest, so the pool keeps what was hot and the load of prefixes stays spread.

Queue lengths may be unknown (a replica not probed yet): an unknown queue is not judged overloaded,
and the least loaded are chosen among the known ones (Serve probes the rest).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingObservation:
    matched_blocks: dict[str, int]  # candidate replica -> leading blocks of the request it holds
    queue_lengths: dict[str, int | None]  # candidate replica -> requests ongoing there (None: unknown)
    overload_margin: int  # queue length over the shortest one at which a replica counts as overloaded


@dataclass(frozen=True)
class RoutingDecision:
    ranks: tuple[tuple[str, ...], ...]  # replicas to try, best rank first
    reason: str  # "prefix", "overloaded" or "no match"


def choose_replicas(observation: RoutingObservation) -> RoutingDecision:
    """The replica holding the longest prefix first, else (overloaded or no match) the least loaded."""
    candidates = sorted(observation.queue_lengths)
    if not candidates:
        return RoutingDecision(ranks=(), reason="no match")
    everyone = tuple(candidates)
    best = max(candidates, key=lambda replica: (observation.matched_blocks.get(replica, 0), replica))
    if observation.matched_blocks.get(best, 0) == 0:
        return RoutingDecision(ranks=(_least_loaded(observation), everyone), reason="no match")
    if _overloaded(best, observation):
        return RoutingDecision(ranks=(_least_loaded(observation), everyone), reason="overloaded")
    return RoutingDecision(ranks=((best,), everyone), reason="prefix")


def _known_queues(observation: RoutingObservation) -> dict[str, int]:
    return {replica: length for replica, length in observation.queue_lengths.items() if length is not None}


def _overloaded(replica: str, observation: RoutingObservation) -> bool:
    known = _known_queues(observation)
    if replica not in known:
        return False
    return known[replica] - min(known.values()) >= observation.overload_margin


def _least_loaded(observation: RoutingObservation) -> tuple[str, ...]:
    """The replicas with the shortest known queue; every candidate when no queue is known yet."""
    known = _known_queues(observation)
    if not known:
        return tuple(sorted(observation.queue_lengths))
    shortest = min(known.values())
    return tuple(sorted(replica for replica, length in known.items() if length == shortest))


def choose_heir(held_blocks: dict[str, int]) -> tuple[tuple[str, ...], ...]:
    """Ranks for a stopping replica's blocks: the peer holding the fewest first, then everyone."""
    if not held_blocks:
        return ()
    everyone = tuple(sorted(held_blocks))
    return (min(everyone, key=lambda replica: (held_blocks[replica], replica)),), everyone
