"""EPLB-style expert placement: hot experts replicated, copies packed so the busiest rank is light."""

import itertools
import random

import pytest

from baige_ray.policies.expert_placement import (
    ExpertPlacement,
    balance_experts,
    imbalance,
    initial_placement,
    rank_tokens,
    replica_shares,
)


def test_without_load_every_expert_has_a_slot_and_spares_copy_the_first_ones():
    placement = initial_placement(num_experts=8, num_ranks=2, slots_per_rank=5)
    assert placement.covers(8) and placement.slots_per_rank == 5
    assert sorted(placement.slots) == [0, 0, 1, 1, 2, 3, 4, 5, 6, 7]
    assert all(len(set(placement.rank_slots(rank))) == 5 for rank in range(2))


def test_a_hot_expert_is_replicated_and_the_busiest_rank_gets_lighter():
    load = [400, 20, 20, 20, 10, 10, 80, 40]
    before = initial_placement(8, num_ranks=4, slots_per_rank=3)
    after = balance_experts(load, num_ranks=4, slots_per_rank=3)
    assert len(after.copies(0)) == 4  # the hot expert on every rank
    assert after.covers(8)
    assert imbalance(rank_tokens(after, load)) < imbalance(rank_tokens(before, load))
    assert imbalance(rank_tokens(after, load)) < 1.2
    assert all(len(set(after.rank_slots(rank))) == 3 for rank in range(4))  # no rank holds an expert twice


def test_the_greedy_packing_is_close_to_the_best_placement_of_the_same_copies():
    rng = random.Random(7)
    for _ in range(20):
        load = [rng.randint(0, 100) for _ in range(6)]
        placement = balance_experts(load, num_ranks=2, slots_per_rank=4)
        found = max(rank_tokens(placement, load))
        pieces = list(placement.slots)
        splits = [(tuple(pieces[i] for i in chosen), tuple(pieces[i] for i in range(8) if i not in chosen))
                  for chosen in itertools.combinations(range(8), 4)]
        best = min(max(rank_tokens(ExpertPlacement(slots=first + second, num_ranks=2), load))
                   for first, second in splits)
        assert found <= best * 1.25 + 1


def test_replica_shares_split_tokens_contiguously_and_evenly():
    assert replica_shares(7, 3) == [3, 2, 2]
    assert replica_shares(0, 2) == [0, 0]
    assert sum(replica_shares(101, 4)) == 101


def test_imbalance_is_the_busiest_rank_over_the_mean():
    assert imbalance([30, 10]) == 1.5
    assert imbalance([0, 0]) == 1.0


@pytest.mark.parametrize("kwargs,message", [
    ({"num_experts": 8, "num_ranks": 2, "slots_per_rank": 3}, "2 ranks x 3 slots cannot hold 8 experts"),
    ({"num_experts": 4, "num_ranks": 2, "slots_per_rank": 5}, "slots_per_rank=5 is invalid: expected at most"),
    ({"num_experts": 4, "num_ranks": 0, "slots_per_rank": 2}, "num_ranks"),
])
def test_impossible_sizes_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        initial_placement(**kwargs)


def test_negative_load_is_refused():
    with pytest.raises(ValueError, match="expert load"):
        balance_experts([1, -1], num_ranks=1, slots_per_rank=2)
