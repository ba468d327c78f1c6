"""The elastic controller driven end to end against an in-process pool (tests/fake_pool.py), no Ray:
detect -> decide -> regroup -> restore, a controller restart, resize, harvest and growth, each
checked by the phases it went through, the events it wrote and where training resumed. The cluster
tests keep the real workers honest; these run in well under a second each."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from actors.controller import ElasticController
from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.job_record import JobRecord
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.gpt import GPTConfig
from baige_ray.models.mlp import MLPConfig
from baige_ray.parallel.layout import ParallelLayout
from tests.fake_pool import FakeCluster, FakeWorkerPool, MemoryKeyValueStore, loss_at

FAST = dict(replicate_every=0, heartbeat_interval_s=0.005, heartbeat_timeout_s=0.3, collective_timeout_floor_s=0.5,
            first_steps_timeout_s=1.0, grow_check_interval_s=0.02)


ONE_RECOVERY = ["starting", "running", "recovering", "running", "finished"]


class ControllerCrashed(BaseException):
    """Raised into the loop where a controller process would have died."""


def controller(tmp_path: Path, cluster: FakeCluster, *, workers: int = 2, steps: int = 6, store=None,
               pool: FakeWorkerPool | None = None, restarted: bool = False, steps_allowed: int | None = None,
               micro_batch_size: int | None = None, model=None, **elastic) -> ElasticController:
    train = TrainConfig(num_steps=steps, global_batch_size=12, micro_batch_size=micro_batch_size)
    job = TrainJob(model=model or MLPConfig(sizes=(4, 4)), train=train, data=None)
    return ElasticController(
        job, ScalingConfig(num_workers=workers, placement_timeout_s=0.5),
        RunConfig(name="fake", storage_path=tmp_path, show_progress=False),
        ElasticConfig(**{**FAST, **elastic}), ParallelLayout(dp=workers),
        pool=pool or FakeWorkerPool(cluster), record=JobRecord("fake", store or MemoryKeyValueStore()),
        was_restarted=lambda: restarted, steps_allowed=steps_allowed,
    )


def phases(ctl: ElasticController) -> list[str]:
    return [t.target.value for t in ctl.machine.history]


def kinds(ctl: ElasticController) -> list[str]:
    return [e["kind"] for e in ctl.events.recent(200)]


def losses(result: dict) -> list[float]:
    return [m["loss"] for m in sorted(result["metrics"], key=lambda m: m["step"])]


def fault_free(steps: int) -> list[float]:
    return [loss_at(step) for step in range(steps)]


def run_in_thread(ctl: ElasticController) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=ctl.run()), daemon=True)
    thread.start()
    return thread, out


def wait_for_workers(ctl: ElasticController, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ctl.status()["num_workers"] != count:
        assert time.monotonic() < deadline, f"the job never had {count} workers"
        time.sleep(0.01)


def wait_for_step(ctl: ElasticController, step: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ctl.step < step:
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.005)


def wait_until(condition, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_fault_free_run_trains_every_step_once(tmp_path):
    cluster = FakeCluster({"n0": 2})
    ctl = controller(tmp_path, cluster)
    result = ctl.run()
    assert phases(ctl) == ["starting", "running", "finished"]
    assert losses(result) == fault_free(6) and result["checkpoint_path"] is not None
    assert kinds(ctl) == ["plan", "start", "finished"]
    assert cluster.live() == []  # the run's end stops every worker


def test_the_status_describes_the_spares_as_the_workers(tmp_path):
    cluster = FakeCluster({"n0": 3})
    result = controller(tmp_path, cluster, num_spares=1).run()
    (spare,) = result["status"]["spares"]
    assert spare["rank"] is None and spare["pid"] not in {None, *(w["pid"] for w in result["status"]["workers"])}


def test_a_killed_worker_is_replaced_by_a_spare_and_no_step_is_lost(tmp_path):
    cluster = FakeCluster({"n0": 3})
    cluster.scripted[1] = {"die_at": 3}
    ctl = controller(tmp_path, cluster, num_spares=1)
    result = ctl.run()
    assert phases(ctl) == ONE_RECOVERY
    assert losses(result) == fault_free(6)
    assert kinds(ctl) == ["plan", "start", "failure", "recovered", "recovered", "finished"]
    (recovery,) = result["recoveries"]
    assert recovery["resumed_step"] == 3 and recovery["lost_steps"] == 1
    assert len(result["workers"]) == 2


def test_without_a_spare_the_job_shrinks_to_the_survivors(tmp_path):
    cluster = FakeCluster({"n0": 3})
    cluster.scripted[2] = {"die_at": 2}
    ctl = controller(tmp_path, cluster, workers=3, min_workers=2)
    result = ctl.run()
    assert phases(ctl) == ONE_RECOVERY
    assert losses(result) == fault_free(6)
    resize = next(e for e in ctl.events.recent(200) if e["kind"] == "resize")
    assert resize["train_devices"] == 2 and resize["resume_step"] == 2
    assert [m["num_workers"] for m in sorted(result["metrics"], key=lambda m: m["step"])] == [3, 3, 2, 2, 2, 2]


@pytest.mark.parametrize("rank, fault, why, resumed", [
    (0, {"freeze_at": 2}, "heartbeats", 2),  # frozen (SIGSTOP): its heartbeats go silent
    (1, {"hang_at": 3}, "still running", 3),  # hung in its step: ended at the deadline, read before it goes
], ids=["frozen", "hung"])
def test_a_frozen_or_hung_worker_is_found_and_replaced(tmp_path, rank, fault, why, resumed):
    cluster = FakeCluster({"n0": 3})
    cluster.scripted[rank] = fault
    ctl = controller(tmp_path, cluster, num_spares=1)
    result = ctl.run()
    failure = next(e for e in ctl.events.recent(200) if e["kind"] == "failure")
    assert failure["rank"] == rank and why in failure["reason"]
    assert phases(ctl) == ONE_RECOVERY
    assert losses(result) == fault_free(6) and result["recoveries"][0]["resumed_step"] == resumed


def test_a_straggler_is_evicted_for_a_spare_after_its_patience(tmp_path):
    cluster = FakeCluster({"n0": 3})
    cluster.scripted[1] = {"lag": 3.0}
    ctl = controller(tmp_path, cluster, num_spares=1, steps=8, straggler_patience=3)
    result = ctl.run()
    straggler = next(e for e in ctl.events.recent(200) if e["kind"] == "straggler")
    assert straggler["rank"] == 1 and phases(ctl) == ONE_RECOVERY
    assert "eviction" in kinds(ctl) and losses(result) == fault_free(8)
    (recovery,) = result["recoveries"]
    assert recovery["lost_steps"] == 0  # read from the straggler itself: nothing redone
    # The first two steps build caches and are not judged: evicted after its third slow step past them
    # (2-4); step 5, queued behind it, completes first.
    assert recovery["resumed_step"] == 6
    assert all(w["pid"] != 0 for w in result["status"]["workers"])


def test_a_spare_lost_with_a_node_no_member_was_on_is_dropped_and_replaced(tmp_path):
    """Nothing else watches a spare: one that died unseen would be counted until a regroup it joined failed."""
    cluster = FakeCluster({"n0": 2, "n1": 1})
    cluster.step_s = 0.01
    ctl = controller(tmp_path, cluster, steps=5000, num_spares=1)
    thread, out = run_in_thread(ctl)
    wait_until(lambda: len(ctl.crew.ready_spares()) == 1, "the spare never started")
    (spare,) = ctl.crew.spares
    cluster.lose_node("n1")  # the spare's node, and no member's
    cluster.add_node("n2", 1)
    wait_until(lambda: "spare_lost" in kinds(ctl), "the lost spare was not noticed")
    wait_until(lambda: [cluster.named(w.name).node for w in ctl.crew.ready_spares()] == ["n2"],
               "no spare was started in its place")
    ctl.stop()
    thread.join(10)
    assert spare not in ctl.crew.spares and phases(ctl) == ["starting", "running", "finished"]
    assert losses(out["result"]) == fault_free(ctl.step)


def test_a_rank_holding_the_batchs_extra_micro_batch_is_not_a_straggler(tmp_path):
    """4 micro-batches on 3 workers: rank 0 trains 2 and takes twice as long. A 3-minute soak evicted
    that rank for a spare five times (the spare became rank 0 and took as long); ranks are judged by
    their pace per sequence now, and a real straggler still is one."""
    cluster = FakeCluster({"n0": 5})
    cluster.step_s = 0.01
    gpt = GPTConfig(num_layers=1, hidden=8, num_heads=2, seq_len=8)  # never built; its plugin allows uneven shares
    ctl = controller(tmp_path, cluster, workers=4, steps=5000, micro_batch_size=3, model=gpt, num_spares=1,
                     min_workers=2, straggler_patience=3)
    thread, out = run_in_thread(ctl)
    wait_for_step(ctl, 3)
    assert ctl.resize(3, "lend 1 to inference") == 3
    shrunk = ctl.step
    wait_for_step(ctl, shrunk + 20)
    last = ctl.accounts.records[-1]
    assert last["num_workers"] == 3 and last["compute_s"][0] == 2 * last["compute_s"][1]
    assert "straggler" not in kinds(ctl)
    slow = ctl.crew.members[2].name
    cluster.named(slow).lag = 3.0
    wait_until(lambda: "eviction" in kinds(ctl), "the straggler was not swapped for the spare")
    ctl.stop()
    thread.join(10)
    (straggler,) = [e for e in ctl.events.recent(200) if e["kind"] == "straggler"]
    assert straggler["rank"] == 2 and straggler["action"] == "replace"
    assert losses(out["result"]) == fault_free(ctl.step)


def test_a_straggler_left_in_place_is_logged_once_with_why_and_each_ranks_compute_is_in_the_step_log(tmp_path):
    cluster = FakeCluster({"n0": 2})
    cluster.scripted[1] = {"lag": 3.0}
    ctl = controller(tmp_path, cluster, steps=8, straggler_patience=3, min_workers=2)  # no spare, no room to shrink
    result = ctl.run()
    (straggler,) = [e for e in ctl.events.recent(200) if e["kind"] == "straggler"]
    assert straggler["rank"] == 1 and straggler["action"] == "tolerate" and "min_workers=2" in straggler["reason"]
    assert "eviction" not in kinds(ctl) and losses(result) == fault_free(8)
    computes = [m["compute_s"] for m in sorted(result["metrics"], key=lambda m: m["step"])]
    assert all(len(c) == 2 and c[1] > 1.5 * c[0] for c in computes[2:])


def test_a_worker_lost_while_the_group_reforms_is_recovered_from_again(tmp_path):
    cluster = FakeCluster({"n0": 4})
    cluster.scripted[1] = {"die_at": 2}
    cluster.scripted[2] = {"die_in_rejoin": True}  # the first spare dies joining the new group
    ctl = controller(tmp_path, cluster, num_spares=2)
    result = ctl.run()
    assert phases(ctl) == ONE_RECOVERY
    assert kinds(ctl).count("failure") == 2
    assert losses(result) == fault_free(6) and len(result["workers"]) == 2
    assert result["recoveries"][0]["resumed_step"] == 2


def test_a_worker_frozen_while_the_group_reforms_is_found_by_its_silence_and_recovered_from(tmp_path):
    cluster = FakeCluster({"n0": 4})
    cluster.scripted[1] = {"die_at": 2}
    cluster.scripted[2] = {"freeze_in_rejoin": True}  # the first spare stops (SIGSTOP) joining the new group
    pool = FakeWorkerPool(cluster)
    pool.regroup_silence_s = 1.0
    ctl = controller(tmp_path, cluster, num_spares=2, pool=pool)
    result = ctl.run()
    first, frozen = [e for e in ctl.events.recent() if e["kind"] == "failure"]
    assert frozen["reason"] == "lost while regrouping (MemberSilent)"
    # One silence after the regroup began (heartbeats went out with it), not a silence and then another.
    assert frozen["time"] - first["time"] < 1.7
    assert losses(result) == fault_free(6) and len(result["workers"]) == 2


def test_a_first_group_that_does_not_form_is_started_again_instead_of_failing_the_job(tmp_path):
    """A member silent while the first group forms (a busy host, a SIGSTOP) raised out of the
    controller: the job failed before its first step. Nothing is trained yet, so it starts over."""
    cluster = FakeCluster({"n0": 3})
    cluster.scripted[1] = {"freeze_in_rejoin": True}
    pool = FakeWorkerPool(cluster)
    pool.regroup_silence_s = 0.5
    ctl = controller(tmp_path, cluster, pool=pool)
    result = ctl.run()
    assert phases(ctl) == ["starting", "running", "finished"]
    again = [e for e in ctl.events.recent() if e["kind"] == "start" and "again" in e["reason"]]
    assert len(again) == 1 and "MemberSilent" not in again[0]["reason"] and "heartbeat" in again[0]["reason"]
    assert losses(result) == fault_free(6) and len(result["workers"]) == 2
    assert not cluster.workers[1].alive  # the silent one was stopped, not left holding its device


def test_a_first_group_that_never_forms_fails_the_job_with_the_reason(tmp_path):
    cluster = FakeCluster({"n0": 2})
    cluster.scripted.update({index: {"die_in_rejoin": True} for index in range(1, 12, 2)})
    ctl = controller(tmp_path, cluster)
    result = ctl.run()
    assert result["phase"] == "failed"
    assert "the first group failed to form 4 times" in ctl.machine.history[-1].reason


def test_regroups_that_fail_every_time_end_the_job_instead_of_replacing_workers_forever(tmp_path):
    """A CI machine's full disk failed every regroup (Ray's object store could not spill): each attempt
    lost the worker joining, started another, and tried again for as long as the test ran."""
    cluster = FakeCluster({"n0": 3})
    cluster.scripted[1] = {"die_at": 2}
    cluster.scripted.update({index: {"die_in_rejoin": True} for index in range(2, 40)})
    ctl = controller(tmp_path, cluster)
    result = ctl.run()
    assert result["phase"] == "failed"
    assert "regrouping failed 11 times in a row" in ctl.machine.history[-1].reason


def test_a_job_below_its_minimum_with_no_capacity_left_fails(tmp_path):
    cluster = FakeCluster({"n0": 1, "n1": 1})
    cluster.hooks.append(lambda worker, step: cluster.lose_node("n1") if step == 2 and "n1" in cluster.slots else None)
    ctl = controller(tmp_path, cluster)
    result = ctl.run()
    assert phases(ctl) == ["starting", "running", "recovering", "failed"]
    assert "no capacity came back" in ctl.machine.history[-1].reason and result["checkpoint_path"] is None
    assert kinds(ctl)[-2:] == ["failure", "failed"] and result["recoveries"] == []
    assert cluster.live() == []


def test_a_resize_down_then_up_regroups_from_the_newest_snapshot(tmp_path):
    cluster = FakeCluster({"n0": 3})
    cluster.step_s = 0.01
    ctl = controller(tmp_path, cluster, workers=3, steps=40, min_workers=1)
    thread, out = run_in_thread(ctl)
    wait_for_step(ctl, 3)
    pids = [w["pid"] for w in ctl.status()["workers"]]
    assert ctl.resize(1, "serve needs two devices") == 1
    shrunk_at = ctl.step
    assert ctl.resize(3, "serve is done") == 3
    thread.join(10)
    result = out["result"]
    assert phases(ctl).count("resizing") == 2 and phases(ctl)[-1] == "finished"
    assert losses(result) == fault_free(40)
    resizes = [e for e in ctl.events.recent(200) if e["kind"] == "resize"]
    assert [e["train_devices"] for e in resizes] == [1, 3] and resizes[0]["resume_step"] == shrunk_at
    assert resizes[0]["released_pids"] == pids[1:] and resizes[1]["released_pids"] == []  # by process


def test_a_shrink_releases_a_straggler_first_and_says_so(tmp_path):
    """A 3-minute soak lent two of four workers away 6 s after one was throttled: the lend released the
    last two ranks, the straggler among them only by chance. The slowest goes first now."""
    cluster = FakeCluster({"n0": 4})
    cluster.step_s = 0.01
    cluster.scripted[0] = {"lag": 3.0}  # rank 0, which a shrink to the first ranks would keep
    ctl = controller(tmp_path, cluster, workers=4, steps=20, min_workers=1, evict_stragglers=False,
                     straggler_patience=3, steps_allowed=8)
    thread, out = run_in_thread(ctl)
    wait_for_step(ctl, 8)
    slow = ctl.crew.members[0].name
    assert ctl.resize(2, "a lend to serving") == 2
    ctl.allow_steps(20)
    thread.join(10)
    assert slow not in [w.name for w in ctl.crew.members]
    (released,) = [e for e in ctl.events.recent(200) if e["kind"] == "straggler"]
    assert released["action"] == "release" and released["rank"] == 0 and "a lend to serving" in released["reason"]
    assert losses(out["result"]) == fault_free(20)


def test_a_spare_growth_used_comes_back_once_a_lends_device_was_held_and_swaps_a_straggler_at_the_floor(tmp_path):
    """The 30-minute soak's miss: growth took the spare, a lend shrank the job to min_workers, and a
    straggler there was tolerated for a minute, as nothing refilled the spare. Spares are refilled on
    free devices now, after the device a lend freed was left to its replica for the hold."""
    cluster = FakeCluster({"n0": 3})
    cluster.step_s = 0.01
    ctl = controller(tmp_path, cluster, workers=2, steps=5000, num_spares=1, min_workers=2, max_workers=3,
                     straggler_patience=3, released_device_hold_s=1.0)
    thread, out = run_in_thread(ctl)
    wait_until(lambda: len(ctl.crew.ready_spares()) == 1, "the spare never started")
    assert ctl.resize(3, "capacity came back") == 3
    assert ctl.crew.spares == [] and cluster.free() == 0
    assert ctl.resize(2, "lend 1 to inference") == 2
    time.sleep(0.4)
    assert cluster.free() == 1 and ctl.crew.spares == [], "a spare took the device the lend freed"
    wait_until(lambda: len(ctl.crew.ready_spares()) == 1, "the spare was not refilled after the hold")
    slow = ctl.crew.members[1].name
    cluster.named(slow).lag = 3.0
    wait_until(lambda: "eviction" in kinds(ctl), "the straggler at min_workers was not swapped for the spare")
    ctl.stop()
    thread.join(10)
    assert slow not in [w.name for w in ctl.crew.members] and len(ctl.crew.members) == 2
    assert losses(out["result"]) == fault_free(ctl.step)


def test_a_member_frozen_in_a_shrinks_regroup_is_lost_and_those_the_shrink_let_go_are_not(tmp_path):
    cluster = FakeCluster({"n0": 4})
    cluster.step_s = 0.01
    pool = FakeWorkerPool(cluster)
    pool.regroup_silence_s = 0.5
    ctl = controller(tmp_path, cluster, workers=4, steps=12, min_workers=1, pool=pool, steps_allowed=4)
    thread, out = run_in_thread(ctl)
    wait_for_step(ctl, 4)
    cluster.named(ctl.crew.members[0].name).freeze_in_rejoin = True  # kept by the shrink, frozen joining
    ctl.resize(2, "a lend to serving")
    ctl.allow_steps(12)
    thread.join(10)
    reasons = sorted(e["reason"] for e in ctl.events.recent(200) if e["kind"] == "failure")
    assert reasons == ["lost while regrouping (MemberSilent)", "released by the shrink", "released by the shrink"]
    assert losses(out["result"]) == fault_free(12)


def test_harvest_ranks_join_beside_replicas_and_are_given_back(tmp_path):
    cluster = FakeCluster({"n0": 2, "n1": 2})
    cluster.step_s = 0.01
    ctl = controller(tmp_path, cluster, workers=2, steps=40, min_workers=1, max_workers=4)
    thread, out = run_in_thread(ctl)
    wait_for_step(ctl, 2)
    assert ctl.harvest(2, 0.5, "replicas are idle") == 2
    assert ctl.status()["num_harvest"] == 2 and ctl.status()["num_workers"] == 4
    assert ctl.harvest(0, 0.5, "replicas are busy") == 0
    thread.join(10)
    result = out["result"]
    harvests = [e for e in ctl.events.recent(200) if e["kind"] == "harvest"]
    assert [e["harvested_devices"] for e in harvests] == [2, 0]
    assert all(2 <= e["resume_step"] < 40 for e in harvests)
    assert phases(ctl) == ["starting", "running", "resizing", "running", "resizing", "running", "finished"]
    assert losses(result) == fault_free(40)


def running_until_n1_is_lost(tmp_path: Path, nodes: dict[str, int]):
    """A 60-step job on every device of `nodes`, running in a thread, shrunk by the loss of node n1."""
    cluster = FakeCluster(nodes)
    cluster.step_s = 0.01
    workers = sum(nodes.values())
    ctl = controller(tmp_path, cluster, workers=workers, steps=60, min_workers=1)
    thread, out = run_in_thread(ctl)
    wait_for_step(ctl, 3)
    cluster.lose_node("n1")
    wait_for_workers(ctl, workers - nodes["n1"])
    return cluster, ctl, thread, out


def test_the_job_grows_back_when_capacity_returns(tmp_path):
    cluster, ctl, thread, out = running_until_n1_is_lost(tmp_path, {"n0": 1, "n1": 1})
    cluster.add_node("n2", 1)
    wait_for_workers(ctl, 2)
    thread.join(10)
    result = out["result"]
    resizes = [e for e in ctl.events.recent(200) if e["kind"] == "resize"]
    assert [e["train_devices"] for e in resizes] == [1, 2] and "capacity came back" in resizes[-1]["reason"]
    assert resizes[0]["resume_step"] >= 3 and resizes[1]["resume_step"] > resizes[0]["resume_step"]
    assert phases(ctl) == ["starting", "running", "recovering", "running", "resizing", "running", "finished"]
    assert losses(result) == fault_free(60)


def test_a_member_lost_while_the_job_grows_is_recovered_from_the_generation_that_formed(tmp_path):
    """The growth regroup (2 -> 3 workers) loses rank 0: recovery reads the 2-worker generation's
    snapshots in its own layout (it read the 3 joining ranks' in the 2-rank layout and raised), and the
    worker that was joining takes the lost rank."""
    cluster, ctl, thread, out = running_until_n1_is_lost(tmp_path, {"n0": 2, "n1": 1})
    cluster.named(ctl.crew.members[0].name).die_in_rejoin = True
    # The joining worker holds an old snapshot, as a survivor left over by an earlier shrink does.
    cluster.scripted[len(cluster.workers)] = {"snapshots": [(0, {"model": {"w": 1.0}, "optimizer": {}})]}
    cluster.add_node("n2", 1)
    thread.join(20)
    result = out["result"]
    assert ctl.status()["state"] == "finished"
    events = ctl.events.recent(200)
    lost_at = next(i for i, e in enumerate(events) if e["reason"] == "lost while regrouping (RayActorError)")
    # Its recovery is recorded like any other (the soak found none: no failure had started a clock for it).
    recovered = next(e for e in events[lost_at:] if e["kind"] == "recovered" and "recovery_s" in e)
    assert recovered["resumed_step"] == events[lost_at]["step"] and recovered["lost_steps"] == 0
    assert losses(result) == fault_free(60)


def test_a_stop_request_ends_the_job_at_a_step_boundary(tmp_path):
    cluster = FakeCluster({"n0": 2})
    cluster.step_s = 0.01
    ctl = controller(tmp_path, cluster, steps=1000)
    thread, out = run_in_thread(ctl)
    wait_for_step(ctl, 2)
    ctl.stop()
    thread.join(10)
    assert phases(ctl) == ["starting", "running", "finished"]
    assert ctl.machine.history[-1].reason == "stopped by request" and kinds(ctl)[-1] == "finished"
    assert 2 <= ctl.step < 1000 and losses(out["result"]) == fault_free(ctl.step)


def test_a_gated_job_runs_only_the_steps_allowed_and_recovers_between_them(tmp_path):
    cluster = FakeCluster({"n0": 3})
    cluster.scripted[1] = {"die_at": 3}
    ctl = controller(tmp_path, cluster, steps_allowed=2, num_spares=1)
    thread, out = run_in_thread(ctl)
    wait_for_step(ctl, 2)
    time.sleep(0.2)
    assert ctl.step == 2 and ctl.status()["steps_allowed"] == 2  # held at the bound, not finished
    assert ctl.allow_steps(4) == 4 and ctl.allow_steps(3) == 4  # the bound never moves back
    wait_for_step(ctl, 4)
    time.sleep(0.2)
    assert ctl.step == 4 and thread.is_alive()
    ctl.allow_steps(6)
    thread.join(10)
    assert phases(ctl) == ONE_RECOVERY and losses(out["result"]) == fault_free(6)
    assert ctl.allow_steps(7) is None  # the job is over


def crash_controller(tmp_path, cluster: FakeCluster, store: MemoryKeyValueStore, *, at_step: int, **elastic) -> None:
    """Run a first controller until a rank finishes `at_step`, where its process dies: what it still asks
    of the pool and the job record afterwards never happens (the workers and the record outlive it)."""
    pool, view = FakeWorkerPool(cluster), store.view()

    def crash(worker, step):
        if step == at_step and not pool.severed:
            pool.sever()
            view.severed = True
            raise ControllerCrashed

    cluster.hooks.append(crash)
    with pytest.raises(ControllerCrashed):
        controller(tmp_path, cluster, store=view, pool=pool, **elastic).run()
    cluster.hooks.clear()


def test_a_restarted_controller_finds_its_workers_and_resumes_where_they_are(tmp_path):
    cluster, store = FakeCluster({"n0": 3}), MemoryKeyValueStore()
    crash_controller(tmp_path, cluster, store, at_step=3, num_spares=1)
    second = controller(tmp_path, cluster, num_spares=1, store=store, restarted=True)
    result = second.run()
    assert phases(second) == ["recovering", "running", "finished"]
    restart = next(e for e in second.events.recent(200) if e["kind"] == "controller_restart")
    assert restart["stopped_strays"] == 1  # the spare the first controller started
    assert losses(result) == fault_free(6)
    assert second.recovery.history[0]["resumed_step"] == 4
    assert cluster.live() == []


def test_a_restarted_controller_replaces_a_worker_lost_while_it_was_down(tmp_path):
    cluster, store = FakeCluster({"n0": 3}), MemoryKeyValueStore()
    crash_controller(tmp_path, cluster, store, at_step=2)
    cluster.workers[1].kill()
    second = controller(tmp_path, cluster, store=store, restarted=True, num_spares=1)
    result = second.run()
    assert "gone when the controller restarted" in [e["reason"] for e in second.events.recent(200)]
    assert phases(second) == ["recovering", "running", "finished"]
    assert losses(result) == fault_free(6) and len(result["workers"]) == 2
    # The killed rank was the one that had finished step 2; the survivor's newest snapshot is step 1's.
    assert second.recovery.history[0]["resumed_step"] == 2


def test_a_second_failure_during_recovery_keeps_the_first_failed_step(tmp_path):
    cluster = FakeCluster({"n0": 4})
    cluster.scripted[0] = {"die_at": 2}
    cluster.scripted[1] = {"die_at": 2}
    # Spares checked once a minute: none is refilled on a freed device to grow the job back in its 6 steps.
    ctl = controller(tmp_path, cluster, workers=3, num_spares=1, min_workers=2, grow_check_interval_s=60.0)
    result = ctl.run()
    assert kinds(ctl).count("failure") == 2 and phases(ctl) == ONE_RECOVERY
    assert losses(result) == fault_free(6) and len(result["workers"]) == 2
    assert result["recoveries"][0]["resumed_step"] == 2


def test_a_controller_restarts_as_often_as_it_is_killed_but_a_crash_loop_fails_the_job(tmp_path):
    """The 30-minute soak's fourth controller SIGKILL ended its job (Ray's restarts were bounded at 3): a
    controller now comes back as often as faults kill it, unless it keeps dying within minutes."""
    from baige_ray.elastic.startup import CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW_S

    def restarted_after(earlier_restarts: list[float], name: str) -> tuple[ElasticController, dict, FakeCluster]:
        cluster, store = FakeCluster({"n0": 3}), MemoryKeyValueStore()
        crash_controller(tmp_path / name, cluster, store, at_step=2)
        store.put(JobRecord("fake", store).key + ":restarts", json.dumps(earlier_restarts))
        second = controller(tmp_path / name, cluster, store=store, restarted=True)
        return second, second.run(), cluster

    now = time.time()
    long_ago = [now - 2 * CRASH_LOOP_WINDOW_S] * 10  # faults met over weeks
    resumed, result, _ = restarted_after(long_ago + [now - 1.0] * (CRASH_LOOP_RESTARTS - 1), "resumes")
    assert phases(resumed) == ["recovering", "running", "finished"] and losses(result) == fault_free(6)
    looping, result, cluster = restarted_after([now - 1.0] * CRASH_LOOP_RESTARTS, "loops")
    assert phases(looping) == ["failed"] and "crash loop" in looping.machine.history[-1].reason
    assert cluster.live() == []  # the workers no controller will lead are stopped


def test_a_worker_frozen_between_steps_is_found_by_a_resize_and_recovered_from(tmp_path):
    """The 30-minute soak froze a worker just before a resize: the resize read its snapshot and waited
    60 s for an answer that never came. Its silence is now checked first."""
    cluster = FakeCluster({"n0": 3})
    cluster.step_s = 0.01
    ctl = controller(tmp_path, cluster, workers=3, steps=8, min_workers=1, steps_allowed=3)
    thread, out = run_in_thread(ctl)
    wait_for_step(ctl, 3)
    time.sleep(0.2)  # held at the bound, between steps
    cluster.named(ctl.crew.members[2].name).freeze()
    began = time.monotonic()
    ctl.resize(2, "a lend to serving")
    assert time.monotonic() - began < 10.0
    ctl.allow_steps(8)
    thread.join(10)
    assert losses(out["result"]) == fault_free(8)
    assert "lost while regrouping" in " ".join(e["reason"] for e in ctl.events.recent(200)
                                                     if e["kind"] == "failure")


def test_a_regroup_failing_after_a_controller_restart_recovers_again_without_the_worker_it_never_found(tmp_path):
    """The 30-minute soak: a restarted controller found 1 of 3 workers, and the regroup that followed
    failed (a joining worker died). Asking the members for heartbeats, it met the rank it had never
    found (no actor) and its loop died with an AttributeError, leaving the job stalled with no event."""
    cluster, store = FakeCluster({"n0": 4}), MemoryKeyValueStore()
    crash_controller(tmp_path, cluster, store, at_step=2)
    cluster.workers[1].kill()
    cluster.scripted[len(cluster.workers)] = {"die_in_rejoin": True}  # the first worker it starts
    second = controller(tmp_path, cluster, store=store, restarted=True, num_spares=1)
    result = second.run()
    assert phases(second)[-1] == "finished" and losses(result) == fault_free(6)
    failures = [e["reason"] for e in second.events.recent(200) if e["kind"] == "failure"]
    assert failures[0] == "gone when the controller restarted" and failures[1].startswith("lost while regrouping")


def test_an_error_in_the_controller_fails_the_job_on_record_instead_of_ending_its_loop(tmp_path, monkeypatch):
    cluster = FakeCluster({"n0": 3})
    ctl = controller(tmp_path, cluster, num_spares=1)
    cluster.scripted[1] = {"die_at": 2}

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(ctl.recovery, "recover", broken)
    result = ctl.run()
    assert phases(ctl) == ["starting", "running", "recovering", "failed"] and result["phase"] == "failed"
    (failed,) = [e for e in ctl.events.recent(200) if e["kind"] == "failed"]
    assert failed["reason"] == "the controller failed while recovering: KeyError('a bug')"
    assert ctl.status()["state"] == "failed" and cluster.live() == []
