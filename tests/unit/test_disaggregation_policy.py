"""The prefill/decode split: each side sized from its own queue, never below its minimum, no thrashing."""

from __future__ import annotations

import dataclasses

import pytest

from baige_ray.policies.disaggregation import SideLoad, SplitObservation, SplitPolicy, split_replicas

POLICY = SplitPolicy(prefill_capacity=4.0, decode_capacity=16.0, margin=0.25, cooldown_s=10.0)


def observe(prefill: tuple[int, int], decode: tuple[int, int], total: int | None = None,
            since: float = 100.0) -> SplitObservation:
    """(replicas, requests) per side; requests count as waiting."""
    sides = [SideLoad(num_replicas=replicas, num_waiting=requests, num_running=0)
             for replicas, requests in (prefill, decode)]
    total = sides[0].num_replicas + sides[1].num_replicas if total is None else total
    return SplitObservation(prefill=sides[0], decode=sides[1], num_replicas=total, seconds_since_move=since)


def split(obs: SplitObservation) -> tuple[int, int]:
    decision = split_replicas(obs, POLICY)
    return decision.prefill_replicas, decision.decode_replicas


def test_replicas_a_lend_adds_go_to_the_busier_side_one_by_one():
    assert split(observe((1, 12), (1, 8), total=3)) == (2, 1)  # prefill at 3.0, decode at 0.5
    assert split(observe((1, 12), (1, 8), total=4)) == (3, 1)  # prefill still at 1.5 with two
    assert split(observe((1, 12), (1, 40), total=4)) == (2, 2)  # decode at 2.5 takes the second


def test_replicas_a_reclaim_takes_come_from_the_side_that_stays_idlest():
    assert split(observe((2, 1), (3, 40), total=4)) == (1, 3)
    assert split(observe((3, 20), (2, 2), total=4)) == (3, 1)
    assert split(observe((1, 0), (3, 60), total=2)) == (1, 1)  # never below a side's minimum


def test_with_the_total_unchanged_one_replica_moves_to_the_side_whose_queue_grew():
    decision = split_replicas(observe((2, 0), (2, 60)), POLICY)
    assert (decision.prefill_replicas, decision.decode_replicas) == (1, 3) and "move one to decode" in decision.reason
    assert split(observe((2, 4), (2, 16))) == (2, 2)  # prefill would be at 1.0 with one: not worth a move
    assert split(observe((2, 0), (2, 60), since=5.0)) == (2, 2)  # cooling down after the last move
    assert split(observe((1, 0), (3, 60))) == (1, 3)  # the idle side is at its minimum


def test_a_steady_load_settles_without_trading_replicas_back_and_forth():
    obs = observe((3, 2), (3, 80))
    history = []
    for _ in range(8):
        counts = split(obs)
        history.append(counts)
        obs = dataclasses.replace(obs, prefill=dataclasses.replace(obs.prefill, num_replicas=counts[0]),
                                  decode=dataclasses.replace(obs.decode, num_replicas=counts[1]))
    assert history == [(2, 4), (1, 5)] + [(1, 5)] * 6  # then prefill is at its minimum


def test_a_side_found_below_its_minimum_is_restored_first():
    assert split(observe((0, 0), (3, 60))) == (1, 2)
    assert split(observe((0, 5), (2, 0), total=4)) == (2, 2)  # then a lend's replica goes where the queue is


def test_every_replica_counts_and_the_minimum_split_is_enforced():
    with pytest.raises(ValueError, match="SplitObservation.num_replicas=3.*at least.*4"):
        split_replicas(observe((2, 0), (2, 0), total=3), SplitPolicy(min_prefill_replicas=2, min_decode_replicas=2))


@pytest.mark.parametrize(("field", "value"), [("prefill_capacity", 0), ("decode_capacity", -1.0), ("margin", -0.1),
                                              ("cooldown_s", "soon"), ("min_prefill_replicas", 0),
                                              ("min_decode_replicas", 1.5)])
def test_policy_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=f"SplitPolicy.{field}"):
        SplitPolicy(**{field: value})


def test_observations_are_validated():
    with pytest.raises(ValueError, match="SideLoad.num_waiting"):
        SideLoad(num_replicas=1, num_waiting=-1, num_running=0)
    with pytest.raises(ValueError, match="SplitObservation.num_replicas"):
        observe((1, 0), (0, 0))
