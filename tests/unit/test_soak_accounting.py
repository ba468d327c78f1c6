"""How the soak matches an injected fault with the job event that noticed it."""

from baige_ray.bench.soak import _job_fault_outcome
from baige_ray.bench.soak_faults import replicas_wanted


def test_a_straggler_is_detected_only_by_the_straggler_policys_decision():
    """A throttled worker killed by a later fault (every worker restarts from a checkpoint) was never found
    slow: the failure that killed it does not count as the straggler's detection."""
    events = [
        {"time": 135.0, "kind": "failure", "reason": "actor died", "rank": 0},
        {"time": 140.0, "kind": "recovered", "reason": "next step done", "recovery_s": 5.0, "lost_steps": 26},
    ]
    straggler = {"kind": "straggler", "at": 100.0, "pid": 7}
    assert _job_fault_outcome(straggler, events) == {"detected_s": None, "recovered_s": None, "steps_lost": None}
    evicted = events + [{"time": 150.0, "kind": "straggler", "reason": "rank 0 is 3x slower", "rank": 0},
                        {"time": 152.0, "kind": "recovered", "reason": "next step done", "recovery_s": 2.0,
                         "lost_steps": 0}]
    assert _job_fault_outcome(straggler, evicted) == {"detected_s": 50.0, "recovered_s": 52.0, "steps_lost": 0}
    tolerated = events + [{"time": 150.0, "kind": "straggler", "reason": "rank 0 is slow", "rank": 0,
                           "action": "tolerate"}]
    assert _job_fault_outcome(straggler, tolerated)["detected_s"] is None  # found, but left in place
    released = events + [{"time": 150.0, "kind": "straggler", "reason": "rank 2 is the slowest", "rank": 2,
                          "action": "release"}, {"time": 151.5, "kind": "resize", "reason": "lend 2 to inference"}]
    assert _job_fault_outcome(straggler, released) == {"detected_s": 50.0, "recovered_s": 51.5, "steps_lost": 0}
    killed = {"kind": "worker_kill", "at": 130.0, "pid": 8}
    assert _job_fault_outcome(killed, evicted)["detected_s"] == 5.0


def test_a_killed_replica_is_back_when_the_application_has_the_replicas_the_arbiter_wants_now():
    assert replicas_wanted(3, 3) == 3
    assert replicas_wanted(3, 2) == 2  # a reclaim while the killed replica restarted
    assert replicas_wanted(2, 3) == 2  # a lend meanwhile asks for a new replica, not the killed one back
    assert replicas_wanted(3, None) == 3  # the arbiter is down: the count before the kill
