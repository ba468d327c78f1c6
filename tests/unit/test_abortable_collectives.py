"""Collectives inside a training step let a survivor go as soon as the controller reports a lost peer.

A peer frozen by SIGSTOP never joins the step's next collective. Gloo cannot interrupt a blocked wait,
so a survivor in a plain `dist.all_reduce` sat out the whole collective timeout (60 s in a new
generation's first steps: a soak froze a worker just after a resize and waited a minute). Two
processes on gloo: rank 1 never reaches the collective, rank 0 is aborted from another thread.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.helpers import spawn_ranks

ABORT_AFTER_S = 0.3
GROUP_TIMEOUT_S = 30.0  # what a survivor would sit out without the abort


def _exact_sum(group) -> None:
    import torch

    from baige_ray.engines.exact_gradients import ExactGradientSum

    weight = torch.nn.Parameter(torch.ones(4))
    weight.grad = torch.full((4,), 0.5)
    summed = ExactGradientSum([weight], total_shards=2, group=group)
    summed.take_shard()
    summed.reduce()


def _gradient_norm(group) -> None:
    import torch

    from baige_ray.parallel.distributed import all_reduce_abortable

    all_reduce_abortable(torch.ones(()), group)


COLLECTIVES = {"exact gradient sum": _exact_sum, "gradient norm": _gradient_norm}


def _rank(rank: int, port: int, results, collective: str) -> None:
    import datetime

    import torch.distributed as dist

    from baige_ray.parallel.distributed import CollectiveAborted, abort_step

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    if rank == 1:  # the frozen peer: in the group, never in the collective, until rank 0 is done
        deadline = time.monotonic() + GROUP_TIMEOUT_S * 2
        while 0 not in results and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    threading.Timer(ABORT_AFTER_S, abort_step).start()
    began = time.monotonic()
    try:
        COLLECTIVES[collective](dist.group.WORLD)
        outcome = "completed"
    except CollectiveAborted:
        outcome = "aborted"
    except Exception as error:  # the collective timed out instead
        outcome = type(error).__name__
    results[0] = (outcome, time.monotonic() - began)
    # The abandoned collective still waits on gloo's thread for the peer: tearing the group down at exit
    # would abort the process; leave without it, as the worker's next generation leaves it behind.
    os._exit(0)


@pytest.mark.parametrize("collective", sorted(COLLECTIVES))
def test_a_survivor_blocked_on_a_frozen_peer_leaves_the_collective_when_aborted(collective):
    outcome, seconds = spawn_ranks(_rank, 2, collective)[0]
    assert outcome == "aborted", f"the collective {outcome} after {seconds:.1f}s"
    assert seconds < ABORT_AFTER_S + 2.0
