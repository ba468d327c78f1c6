from baige_ray.elastic.replicas import exposed_stages, replica_holders


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
