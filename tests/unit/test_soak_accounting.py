"""How the soak matches an injected fault with the job event that noticed it."""

from types import SimpleNamespace

from baige_ray.bench.soak import _job_fault_outcome
from baige_ray.bench.soak_faults import replicas_wanted


def test_a_straggler_is_detected_only_by_the_straggler_policys_word_and_recovered_once_the_job_is_off_it():
    """A throttled worker killed by a later fault (every worker restarts from a checkpoint) before the
    policy named it was never found slow: the failure that killed it does not count as its detection. One
    the policy named and tolerated (no spare ready) is recovered only once its process is gone."""
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
    # Found, but left in place until its throttle ended: not recovered.
    assert _job_fault_outcome(straggler, tolerated) == {"detected_s": 50.0, "recovered_s": None, "steps_lost": None}
    # Left in place, then taken by another fault: recovered with that fault's recovery, its steps that fault's.
    taken = {**straggler, "throttle": SimpleNamespace(gone_at=155.0)}
    killed_later = tolerated + [{"time": 155.1, "kind": "failure", "reason": "actor died", "rank": 0},
                                {"time": 160.0, "kind": "recovered", "reason": "next step done", "recovery_s": 4.9,
                                 "lost_steps": 1}]
    assert _job_fault_outcome(taken, killed_later) == {"detected_s": 50.0, "recovered_s": 60.0, "steps_lost": 0}
    assert _job_fault_outcome(straggler, killed_later)["recovered_s"] is None  # its process never went away
    released = events + [{"time": 150.0, "kind": "straggler", "reason": "rank 2 is the slowest", "rank": 2,
                          "action": "release"}, {"time": 151.5, "kind": "resize", "reason": "lend 2 to inference"}]
    assert _job_fault_outcome(straggler, released) == {"detected_s": 50.0, "recovered_s": 51.5, "steps_lost": 0}
    killed = {"kind": "worker_kill", "at": 130.0, "pid": 8}
    assert _job_fault_outcome(killed, evicted)["detected_s"] == 5.0


def test_a_straggler_a_lend_released_before_the_policy_named_it_is_recovered_at_that_resize_not_detected():
    """A CI soak throttled a worker 6 s before a lend shrank the job from 4 workers to 2: the shrink let
    it go among the last ranks before its slow steps were enough to name it, and the soak reported it
    neither detected nor recovered. The resize names the processes it released."""
    straggler = {"kind": "straggler", "at": 6871.6, "pid": 6001}
    lend = {"time": 6877.7, "kind": "resize", "reason": "lend 2 to inference", "train_devices": 2,
            "released_pids": [6001, 6002]}
    assert _job_fault_outcome(straggler, [lend]) == {"detected_s": None, "recovered_s": 6877.7 - 6871.6,
                                                     "steps_lost": 0, "released_unnamed": True}
    other = {**lend, "released_pids": [6002, 6003]}  # it stays in the job: the policy must still name it
    assert _job_fault_outcome(straggler, [other])["recovered_s"] is None
    named_first = [{"time": 6875.0, "kind": "straggler", "reason": "rank 1 is slow", "rank": 1, "action": "release"},
                   lend]
    assert _job_fault_outcome(straggler, named_first) == {"detected_s": 6875.0 - 6871.6,
                                                          "recovered_s": 6877.7 - 6871.6, "steps_lost": 0}


def test_a_fault_in_the_middle_of_another_ones_recovery_is_charged_only_what_it_moves_the_resume_point_back():
    """A node lost 13 s into the recovery from a corrupted checkpoint (every worker killed, restored from the
    checkpoint before it): one recovery record covers both and counts 27 steps redone since the first
    failure. They are the checkpoint's; the node loss left the resume point where it was."""
    events = [
        {"time": 132.0, "kind": "failure", "reason": "actor died", "rank": 0},
        {"time": 132.0, "kind": "checkpoint", "reason": "skipped persisted step 1274: fails its SHA-256 check",
         "step": 1274},
        {"time": 144.8, "kind": "resize", "reason": "1 usable worker(s) < min_workers=2", "resume_step": 1250},
        {"time": 145.1, "kind": "failure", "reason": "actor died", "rank": 0},
        {"time": 151.2, "kind": "recovered", "reason": "1 spare(s) take the lost rank(s)", "resume_step": 1250},
        {"time": 151.2, "kind": "recovered", "reason": "next step done", "recovery_s": 19.2, "lost_steps": 27},
    ]
    corrupt = {"kind": "checkpoint_corrupt", "at": 131.5, "corrupted_step": 1274}
    node = {"kind": "node_loss", "at": 145.0}
    assert _job_fault_outcome(corrupt, events)["steps_lost"] == 27
    outcome = _job_fault_outcome(node, events)
    assert outcome["steps_lost"] == 0 and round(outcome["recovered_s"], 3) == 6.2
    # Had it sent the job further back (its snapshot gone with the node), it would be charged the difference.
    further = [dict(e, resume_step=1225) if e["time"] == 151.2 and "resume_step" in e else e for e in events]
    assert _job_fault_outcome(node, further)["steps_lost"] == 25


def test_a_killed_replica_is_back_when_the_application_has_the_replicas_the_arbiter_wants_now():
    assert replicas_wanted(3, 3) == 3
    assert replicas_wanted(3, 2) == 2  # a reclaim while the killed replica restarted
    assert replicas_wanted(2, 3) == 2  # a lend meanwhile asks for a new replica, not the killed one back
    assert replicas_wanted(3, None) == 3  # the arbiter is down: the count before the kill
