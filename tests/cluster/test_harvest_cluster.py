"""Harvest a serving device for training and give it back, under steady request load.

The replica holds 3/4 of its device; the harvest rank takes the other 1/4, so it lands beside the
replica (the rest of the pool is reserved). No request may fail, the replica keeps serving through
both moves, and training's loss continues where it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import urllib.request

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

import baige_ray as br
from baige_ray.actors.arbiter import ArbiterConfig, ArbiterLoop, JobTrainingSide
from baige_ray.actors.serving_sides import ServeServingSide
from baige_ray.api.elastic import ElasticConfig
from baige_ray.jobs.launch import launch
from baige_ray.ops.events import EventLog
from baige_ray.policies.lending import LendingAction, LendingPolicy
from baige_ray.serving import replica_states, serve, shutdown
from tests.cluster.test_colocate_cluster import SteadyLoad, assert_training_continues
from tests.helpers import free_port

MODEL = br.GPTConfig(seq_len=32, num_layers=1, num_heads=2, hidden=32)
SHARE = 0.25
NICENESS = 5  # training yields the host's CPU to the replica beside it
POOL_GPUS = 8


@ray.remote(num_cpus=0)
class Probe:
    """A plain actor: the niceness Ray gives its worker processes."""

    def niceness(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)


@pytest.fixture(scope="module")
def job_app_and_reservation(sim_cluster):
    job = launch(MODEL, train=br.TrainConfig(num_steps=100_000, global_batch_size=12, warmup_steps=2),
                 scaling=br.ScalingConfig(num_workers=3, cpu_niceness=NICENESS), run=br.RunConfig(name="harvest-test"),
                 elastic=ElasticConfig(min_workers=3, max_workers=4))
    deadline = time.monotonic() + 120
    while (status := job.status())["state"] != "running" or status["step"] < 5:
        assert time.monotonic() < deadline, f"training did not start: {status['state']}"
        time.sleep(0.5)
    info = serve(job.latest_model_state(), model_config=MODEL, name="harvest-test", port=free_port(),
                 device_share=1 - SHARE)
    # The rest of the pool is busy (other tenants): a quarter device is free only beside the replica.
    others = placement_group([{"GPU": 1.0}] * (POOL_GPUS - 3 - 1), strategy="SPREAD")
    ray.get(others.ready(), timeout=60)
    yield job, info
    remove_placement_group(others)
    shutdown(info)
    try:  # the job must be gone before the next module lists the cluster's jobs
        job.stop()
        job.wait(timeout_s=120)
    except Exception:  # the test already stopped the job and its controller is gone
        pass


def arbiter(job, info, capacity: float, events: EventLog) -> ArbiterLoop:
    """A loop whose capacity estimate is fixed, so the steady load reads as light or heavy."""
    policy = LendingPolicy(lend_above=0.8, target_utilization=0.6, reclaim_below=0.3, harvest_below=0.4,
                           cooldown_s=0.0, breach_cooldown_s=0.0)
    config = ArbiterConfig(slo_p99_s=30.0, replica_capacity=capacity, capacity_from_reports=False,
                           min_train_devices=3, train_sizes=(3, 4), load_window_s=3.0, policy=policy,
                           harvest_share=SHARE)
    return ArbiterLoop(JobTrainingSide(job.name), ServeServingSide(info, dataclasses.asdict(MODEL)), config,
                       events=events)


def replica_device(url: str) -> tuple[str, int]:
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=30).read())
    return health["node_id"], health["devices"][0]


def test_harvest_and_give_back_lose_no_request_and_training_continues(job_app_and_reservation):
    job, info = job_app_and_reservation
    events = EventLog(None)
    started = time.time()
    with SteadyLoad(info.url + "/generate") as load:
        time.sleep(4)  # a load window of requests before deciding
        step_at_harvest = job.status()["step"]
        harvest = arbiter(job, info, capacity=1000.0, events=events).tick()
        assert (harvest.action, harvest.num_devices) == (LendingAction.HARVEST, 1)
        status = job.status()
        assert (status["num_workers"], status["num_harvest"]) == (4, 1)
        shared = [(w["node_id"], w["device_index"]) for w in status["workers"] if w["share"] < 1]
        assert shared == [replica_device(info.url)]  # the rank runs on the replica's device
        assert replica_states(info) == {"RUNNING": 1}
        pids = [w["pid"] for w in status["workers"]]
        expected = min(19, ray.get(Probe.remote().niceness.remote()) + NICENESS)  # on top of Ray's own
        assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {expected}  # the harvest rank's too
        while job.status()["step"] < step_at_harvest + 8:  # trains with the harvest rank
            time.sleep(0.5)
        give_back = arbiter(job, info, capacity=0.5, events=events).tick()  # ~5 req/s reads as overload
        assert (give_back.action, give_back.num_devices) == (LendingAction.UNHARVEST, 1)
        status = job.status()
        assert (status["num_workers"], status["num_harvest"]) == (3, 0)
        assert replica_states(info) == {"RUNNING": 1}
        time.sleep(2)
    assert load.statuses and set(load.statuses) == {200}, f"failed requests: {load.statuses}"
    assert [(e["kind"], e["train_devices"], e["infer_devices"], e["harvested_devices"])
            for e in events.recent()] == [("harvest", 3, 1, 1), ("unharvest", 3, 1, 0)]

    regroups = [e["harvested_devices"] for e in job.status()["events"] if e["kind"] == "harvest" and e["time"] >= started]
    assert regroups == [1, 0]  # the controller switched in and out in one regroup each
    assert_training_continues(job, since_step=step_at_harvest)
