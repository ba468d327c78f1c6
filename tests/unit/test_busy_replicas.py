"""A rollout fault kills a replica that reported it holds requests, never one it already killed."""

from __future__ import annotations

import threading

from baige_ray.rl.rollouts import BusyReplicas


def test_the_first_busy_replica_not_yet_killed_is_returned_once_it_reports():
    busy = BusyReplicas()
    assert busy.wait_for_one(0.01) is None
    threading.Timer(0.05, busy.started, args=(41,)).start()
    assert busy.wait_for_one(5.0) == 41
    busy.started(41)  # a second group on the same replica
    busy.started(7)
    assert busy.wait_for_one(5.0, besides=[41]) == 7
    assert busy.wait_for_one(0.01, besides=[41, 7]) is None
