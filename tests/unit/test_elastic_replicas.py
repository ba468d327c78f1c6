from baige_ray.planner.replicas import exposed_stages, replica_floor, replica_holders, stages_behind


def test_stages_with_holders_on_two_nodes_are_not_exposed():
    # DP2 x PP2: stage 0 on nodes a and b, stage 1 only on b.
    assert exposed_stages([0, 1, 0, 1], ["a", "b", "b", "b"]) == [1]
    assert exposed_stages([0, 0, 0, 0], ["a", "a", "b", "b"]) == []


def test_a_single_node_job_has_every_stage_exposed():
    assert exposed_stages([0, 0, 1, 1], ["a"] * 4) == [0, 1]


def test_holders_are_on_distinct_nodes_earliest_first():
    assert replica_holders(["a", "a", "b", "c"]) == [0, 2]
    assert replica_holders(["b", "a"], copies=3) == [0, 1]


def test_no_holders_when_every_candidate_shares_one_node():
    assert replica_holders(["a", "a", "a"]) == []
    assert replica_holders([]) == []


def test_stages_behind_the_newest_snapshot_are_read_again():
    assert stages_behind({0: 7, 1: 8, 2: 8, 3: 7}) == [0, 3]
    assert stages_behind({0: 8, 1: 8}) == []
    assert stages_behind({}) == []


def test_the_replica_floor_is_the_snapshot_whose_copy_began_a_full_step_ago():
    # Dispatching step 10 (step 9 runs, 8 just ended): the copy of step 7 has had all of step 8.
    assert replica_floor(10, generation_start=0) == 7
    assert replica_floor(10, generation_start=0, replicate_every=2) == 7  # copies after steps 1, 3, 5, 7
    assert replica_floor(11, generation_start=0, replicate_every=2) == 7
    assert replica_floor(10, generation_start=0, snapshot_every=3) == 6  # snapshots after steps 0, 3, 6
    assert replica_floor(12, generation_start=0, snapshot_every=2, replicate_every=3) == 8


def test_no_replica_floor_before_this_generation_has_copied_a_snapshot():
    assert replica_floor(7, generation_start=5) is None
    assert replica_floor(8, generation_start=5) == 5
    assert replica_floor(2, generation_start=0) is None


def test_replica_copies_are_served_by_each_rank_of_a_stage_in_turn():
    from types import SimpleNamespace

    from baige_ray.elastic.state_sources import replica_sources

    members = [SimpleNamespace(actor=f"actor{rank}") for rank in range(4)]
    stages = [0, 0, 1, 1]  # two replicas of a two-stage pipeline
    assert [replica_sources(members, stages, False, turn) for turn in range(3)] == [
        {0: "actor0", 1: "actor2"}, {0: "actor1", 1: "actor3"}, {0: "actor0", 1: "actor2"}]
    assert replica_sources(members, stages, True, 5) == {rank: f"actor{rank}" for rank in range(4)}
