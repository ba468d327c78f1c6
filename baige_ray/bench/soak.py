"""Chaos under load: an elastic job and a served application on one pool, faults at seeded random moments.

On the simulated 2 x 4 cluster: a tiny Hugging Face Llama trains as an elastic job (4 workers, one
warm spare, checkpoints persisted every 25 steps, a constant learning rate after the warm-up), while 2
replicas of the built-in engine serve it and the pool arbiter moves devices between the two. A replayed
request load (Poisson arrivals) runs against the replicas over HTTP: `--rate` requests/s, with seeded
spikes at `--spike-utilization` of what the 2 replicas answer (measured before the soak), which the
arbiter meets by lending a training device and ends by taking it back. Faults come at seeded moments
(soak_schedule.py), carried out by soak_faults.py: a worker SIGKILLed, frozen with SIGSTOP or throttled
into a straggler, a replica SIGKILLed, the controller SIGKILLed, the arbiter SIGKILLed, the worker node
stopped and started again, and the newest persisted checkpoint damaged while every worker and spare is
killed (the job must skip it and restore the one before), and the checkpoints' disk filled to the last
byte for 20 s.

Reported per fault kind: injected, detected, recovered, detection and recovery seconds (p50, max) and
steps lost. A job fault is detected at the job's first event that answers it (a "failure" or
"straggler"; a "controller_restart"; a skipped persisted checkpoint) and recovered at the next
"recovered" event (whose record names the steps redone), or for a straggler a shrink released (a lend)
at that shrink's "resize" (one released before the policy named it is reported recovered there, not
detected, with `released_unnamed`), and for one the policy tolerated until another fault took its
process, at that fault's recovery; a replica fault is detected when Ray lists the
replica dead and recovered when the application has its replicas again (as many as the arbiter
wants then, where it took a device back meanwhile); an arbiter fault is detected
when Ray has restarted it and recovered at its first decision after that. For serving: requests, failed
requests (those in flight when a replica was killed or its node lost, and all others), the share
answered within `--slo-s`. For the run: the final loss against a fault-free run of the same steps, each
long-lived process's resident memory from a third of the soak (the tenth minute at most) to the end, and
the processes still alive after the cluster shut down; the arbiter's lends and reclaims.

The checkpoints' disk is filled only where the soak may mount a tmpfs of its own for them (root);
elsewhere that kind is listed under `not_injected`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baige_ray.bench.measure import report_stage
from baige_ray.bench.soak_faults import FaultInjector, checkpoint_volume, persist_failed, process_alive
from baige_ray.bench.soak_memory import memory_growth
from baige_ray.bench.soak_schedule import FAULT_KINDS, ScheduledFault, fault_schedule, spiky_rates

NUM_WORKERS, NUM_REPLICAS = 4, 2
JOB_EVENT_WAIT_S = 90.0  # a fault no event answers within this is counted undetected
RUN_NAME = "soak"
FOLLOWED_BY_THE_INJECTOR = ("replica_kill", "arbiter_kill")  # not through the job's events
PROCESS_FAULTS = ("worker_kill", "worker_freeze", "straggler", "controller_kill")  # at most 1 step each
MEMORY_EVERY_S = 10.0
# After the load's last answer, before the last memory sample: the arbiter (1-s poll, replicas report every
# 0.5 s) sees the backlog drained and has Serve's proxies give back what it left them. The last sample then
# measures what the processes keep, not the last burst's high-water mark.
SETTLE_AFTER_LOAD_S = 5.0
SEGMENT_S = 20.0  # the load's rate changes (a spike or not) at this period
# A spike's requests wait for the lend it prompts (14-28 s here) instead of being shed with 503 once 256
# are queued (serve's default; Serve's own queues without a bound): a 20-s spike at up to 100 requests/s.
SPIKE_QUEUE = 2048
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=30.0, help="how long faults and load run")
    parser.add_argument("--seed", type=int, default=0, help="the fault schedule's and the load's seed")
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s of the replayed load between spikes")
    parser.add_argument("--spike-utilization", type=float, default=0.9,
                        help="the load's spikes, as a share of what the served replicas answer (measured)")
    parser.add_argument("--slo-s", type=float, default=2.0, help="the latency a request is answered within")
    parser.add_argument("--work-dir", default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from baige_ray.models.hf.tiny import make_llama_tiny
    from baige_ray.topology.connect import open_cluster

    duration_s = args.minutes * 60
    if duration_s <= 0 or args.rate <= 0 or args.spike_utilization <= 0:
        raise ValueError(f"--minutes={args.minutes}, --rate={args.rate} and --spike-utilization="
                         f"{args.spike_utilization} are invalid: expected > 0")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-soak-"))
    model, data = make_llama_tiny(work / "llama", seq_len=64, vocab_size=512, shape=SHAPE, name="llama-soak")
    schedule = fault_schedule(duration_s, args.seed)
    seen_pids: set[int] = set()
    with checkpoint_volume(work / "checkpoints") as own_volume, \
            open_cluster("sim-2x4", log_to_driver=False):
        report_stage(args, "soak: training, serving and faults", 0, 2)
        soak = _soak(args, model, data, work, schedule, duration_s, seen_pids, own_volume)
        report_stage(args, "the fault-free run of the same steps", 1, 2)
        clean = _fault_free(model, data, work, soak["steps_done"])
    soak["left_behind"] = _still_alive(seen_pids)
    return _summary(soak, {m.step: m.loss for m in clean.metrics}, args)


# ----- the soak -----------------------------------------------------------------------------------------


def _train_config(num_steps: int):
    from baige_ray.api.configs import TrainConfig

    # Constant after the warm-up: the first steps of any run are the same steps, whatever num_steps says.
    # Gradients summed exactly over micro-batches of 3: the job trains the same bits on 4, 3 or 2 workers.
    return TrainConfig(num_steps=num_steps, global_batch_size=12, micro_batch_size=3, learning_rate=2e-3,
                       min_learning_rate=2e-3, warmup_steps=10, seed=0, world_size_invariant=True)


def _elastic_job(model, data, work: Path, name: str):
    """The soak's job: elastic, a warm spare, a checkpoint persisted every 25 steps; it trains until stopped."""
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.api.elastic import ElasticConfig
    from baige_ray.jobs.launch import launch

    elastic = ElasticConfig(num_spares=1, min_workers=2, max_recoveries=10_000, persist_every=25,
                            persist_path=work / "checkpoints")
    return launch(model, data=data, train=_train_config(1_000_000), scaling=ScalingConfig(num_workers=NUM_WORKERS),
                  run=RunConfig(name=name, storage_path=work / "runs", show_progress=False), elastic=elastic)


def _fault_free(model, data, work: Path, num_steps: int):
    """The same steps without faults, serving or snapshots, by `fit` in one worker process: the gradients are
    summed exactly (`world_size_invariant`), so the job on 4, 3 or 2 workers must train the bits one process
    trains (21,607 steps of a 30-minute soak: the same final loss to the last bit, in 11 minutes)."""
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.jobs.fit import fit

    return fit(model, data=data, train=_train_config(num_steps), scaling=ScalingConfig(num_workers=1),
               run=RunConfig(name="soak-fault-free", storage_path=work / "runs", show_progress=False))


def _soak(args, model, data, work: Path, schedule: list[ScheduledFault], duration_s: float,
          seen_pids: set[int], checkpoints_on_own_volume: bool) -> dict[str, Any]:
    import ray

    from baige_ray.actors.arbiter import start_pool_arbiter
    from baige_ray.bench.colocate_load import arrival_times, replay, saturated_throughput
    from baige_ray.serving.app import serve, shutdown

    info = serve(model.path, model_config=model, name="soak", num_replicas=NUM_REPLICAS, port=8019,
                 max_queued_requests=SPIKE_QUEUE)
    job = _elastic_job(model, data, work, RUN_NAME)
    arbiter = None
    try:
        job.wait_for_step(3, 300.0)  # the workers are up and stepping
        capacity = saturated_throughput(info.url + "/generate") / NUM_REPLICAS  # beside training, as in the soak
        arbiter = start_pool_arbiter(RUN_NAME, info, model, _arbiter_config(args, capacity, work))
        memory = _MemorySampler(seen_pids, lambda: {w["pid"] for w in job.status()["workers"]})
        injector = FaultInjector(job, RUN_NAME, info.app_name, arbiter, work / "checkpoints", seen_pids,
                                 checkpoints_on_own_volume=checkpoints_on_own_volume)
        spike_rate = max(args.rate, args.spike_utilization * capacity * NUM_REPLICAS)
        rates = spiky_rates(duration_s, args.rate, spike_rate, args.seed, segment_s=SEGMENT_S)
        arrivals = [at for at in arrival_times(rates, hour_s=SEGMENT_S, seed=args.seed) if at < duration_s]
        answers: list = []
        load = threading.Thread(target=lambda: answers.extend(replay(info.url + "/generate", arrivals)), daemon=True)
        started = time.monotonic()
        load.start()
        outcomes = []
        for fault in schedule:
            time.sleep(max(0.0, started + fault.at_s - time.monotonic()))
            outcomes.append(injector.inject(fault))
        time.sleep(max(0.0, started + duration_s - time.monotonic()))
        load.join(timeout=120.0)
        time.sleep(SETTLE_AFTER_LOAD_S)
        memory.stop()
        job.stop()
        result = job.wait(timeout_s=300.0)
    finally:
        if arbiter is not None:  # mid-lend perhaps (a lend waits for training to shrink): its log has its moves
            ray.kill(arbiter, no_restart=True)
        shutdown(info)
    events = _job_events(work / "runs" / RUN_NAME / "events.jsonl")
    wall_started = time.time() - (time.monotonic() - started)
    not_injected = [o for o in outcomes if "skipped" in o]
    outcomes = [o for o in outcomes if "skipped" not in o]
    for outcome in outcomes:
        if outcome["kind"] not in FOLLOWED_BY_THE_INJECTOR and "detected_s" not in outcome:
            outcome.update(_job_fault_outcome(outcome, events))
    # Requests in flight on a replica that died: one killed, or every one on a lost node.
    kills = [o["at"] - wall_started for o in outcomes if o["kind"] in ("replica_kill", "node_loss")]
    moves = [e for e in _job_events(work / "arbiter-events.jsonl") if e["kind"] in ("lend", "reclaim")]
    return {"faults": outcomes, "not_injected": not_injected, "requests": [vars(a) for a in answers],
            "replica_kills_s": kills,
            "replica_capacity": capacity, "spike_rate": spike_rate,
            "lends": [round(e["took_s"], 1) for e in moves if e["kind"] == "lend"],
            "reclaims": [round(e["took_s"], 1) for e in moves if e["kind"] == "reclaim"],
            "losses": {m.step: m.loss for m in result.metrics}, "steps_done": max(m.step for m in result.metrics) + 1,
            "memory": memory.growth(min(600.0, duration_s / 3)), "started": started}


def _arbiter_config(args, capacity: float, work: Path):
    """Lend when the replicas run above 80% of what they answer, take back below 45%: a spike lends, the
    base load after it reclaims. Training keeps 2 of its 4 workers (sizes dividing the batch of 12)."""
    from baige_ray.actors.arbiter import ArbiterConfig
    from baige_ray.policies.lending import LendingPolicy

    # The capacity stays the one measured (closed loop, beside training): what replicas report per busy
    # second counts a full batch as fast, and a spike then read as 0.5 utilization lent nothing.
    return ArbiterConfig(slo_p99_s=args.slo_s, replica_capacity=capacity, capacity_from_reports=False,
                         min_train_devices=2,
                         min_infer_devices=NUM_REPLICAS, train_sizes=(2, 3, 4), load_window_s=4.0,
                         trend_window_s=None, policy=LendingPolicy(cooldown_s=10.0, breach_cooldown_s=10.0),
                         event_log=work / "arbiter-events.jsonl")


def _job_events(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _answers(outcome: dict[str, Any]) -> Callable[[dict], bool]:
    """Which event of the job's log says it noticed `outcome`'s fault."""
    if outcome["kind"] == "controller_kill":
        return lambda event: event["kind"] == "controller_restart"
    if outcome["kind"] == "checkpoint_corrupt":
        return lambda event: (event["kind"] == "checkpoint" and event["reason"].startswith("skipped persisted step")
                              and event.get("step") == outcome["corrupted_step"])
    if outcome["kind"] == "checkpoint_disk_full":
        return persist_failed
    if outcome["kind"] == "straggler":
        # Only the straggler policy's word, "tolerate" too: a throttled worker that another fault killed
        # before the policy named it (a corrupted checkpoint's restart) was not found slow. The event names
        # a rank, not a process: a worker slowed by the load on its cores at the same time would be counted.
        return lambda event: event["kind"] == "straggler"
    return lambda event: event["kind"] == "failure"


def _job_fault_outcome(outcome: dict[str, Any], events: list[dict]) -> dict[str, Any]:
    """When the job noticed a fault injected at `outcome["at"]` (wall clock), when it recovered, steps redone."""
    at, answers = outcome["at"], _answers(outcome)
    noticed = next((e for e in events if e["time"] >= at and answers(e) and e["time"] - at <= JOB_EVENT_WAIT_S), None)
    if outcome["kind"] == "straggler":
        released = _released_unnamed(outcome, noticed, events)
        if released is not None:
            return released
    if noticed is None:
        return {"detected_s": None, "recovered_s": None, "steps_lost": None}
    if outcome["kind"] == "checkpoint_disk_full":  # training never stopped: recovered once a checkpoint lands again
        persisted = next((e for e in events if e["time"] >= outcome["freed_at"] and e["kind"] == "checkpoint"
                          and e["reason"].startswith("persisted step")), None)
        until = persisted["time"] if persisted is not None else float("inf")
        failed = sum(at <= e["time"] <= until and persist_failed(e) for e in events)
        recovered = None if persisted is None else persisted["time"] - at
        return {"detected_s": noticed["time"] - at, "recovered_s": recovered, "steps_lost": 0,
                "checkpoints_failed": failed}
    if outcome["kind"] == "straggler":
        return _straggler_outcome(outcome, noticed, events)
    return _recovery_after(noticed["time"], at, noticed["time"] - at, events)


def _released_unnamed(outcome: dict[str, Any], noticed: dict | None, events: list[dict]) -> dict[str, Any] | None:
    """A straggler a shrink (a lend) released before the policy named it: the job no longer runs on it, at
    that resize, though nothing detected it (a throttle met 6 s before a lend in a 3-minute soak; the
    policy names one after `straggler_patience` slow steps in a row). None: no such release."""
    at = outcome["at"]
    released = next((e for e in events if e["time"] >= at and e["kind"] == "resize"
                     and outcome["pid"] in e.get("released_pids", ())), None)
    if released is None or (noticed is not None and noticed["time"] <= released["time"]):
        return None
    return {"detected_s": None, "recovered_s": released["time"] - at, "steps_lost": 0, "released_unnamed": True}


def _straggler_outcome(outcome: dict[str, Any], noticed: dict, events: list[dict]) -> dict[str, Any]:
    """A straggler is recovered when the job no longer runs on it: evicted or replaced (the recovery's
    record), released by a shrink (that shrink's "resize": training never stopped), or, where the policy
    tolerated it (no spare ready, a shrink not worth it), taken by another fault (its process gone, then
    the job's next recovery; the steps that recovery redid are that fault's). A straggler tolerated until
    its throttle ended was not recovered."""
    at = outcome["at"]
    throttle = outcome.get("throttle")
    gone_at = throttle.gone_at if throttle is not None else None
    acted = next((e for e in events if e["time"] >= noticed["time"] and e["kind"] == "straggler"
                  and e.get("action") != "tolerate" and (gone_at is None or e["time"] <= gone_at)), None)
    detected = noticed["time"] - at
    if acted is not None and acted.get("action") == "release":
        resized = next((e for e in events if e["time"] >= acted["time"] and e["kind"] == "resize"), None)
        return {"detected_s": detected, "recovered_s": None if resized is None else resized["time"] - at,
                "steps_lost": 0}
    if acted is not None:
        return _recovery_after(acted["time"], at, detected, events)
    if gone_at is not None:
        return {**_recovery_after(gone_at, at, detected, events), "steps_lost": 0}
    return {"detected_s": detected, "recovered_s": None, "steps_lost": None}


def _recovery_after(since: float, at: float, detected_s: float, events: list[dict]) -> dict[str, Any]:
    """The first recovery after `since`, by its own record: the "recovered" event of its first step done
    (an earlier one says what it decided)."""
    recovered = next((e for e in events if e["time"] >= since and e["kind"] == "recovered" and "recovery_s" in e),
                     None)
    steps_lost = None if recovered is None else recovered.get("lost_steps")
    underway = _resume_point_underway(at, events)
    resumed = next((e["resume_step"] for e in events if e["time"] >= since and "resume_step" in e), None)
    if steps_lost is not None and underway is not None and resumed is not None:
        steps_lost = max(0, underway - resumed)
    return {"detected_s": detected_s, "recovered_s": None if recovered is None else recovered["time"] - at,
            "steps_lost": steps_lost}


def _resume_point_underway(at: float, events: list[dict]) -> int | None:
    """The step an earlier fault's recovery, still under way at `at`, had decided to resume from (None:
    none was under way, or it had not decided yet).

    A recovery's record counts the steps redone since the first failure it met, which are the earlier
    fault's: a fault striking in the middle of it costs only as far as it moves that resume point back.
    (A 3-minute soak lost a node 13 s into the recovery from a corrupted checkpoint and was charged the
    27 steps the checkpoint cost.)"""
    before = [e for e in events if e["time"] < at]
    last_done = max((e["time"] for e in before if e["kind"] == "recovered" and "recovery_s" in e), default=None)
    failures = [e["time"] for e in before if e["kind"] in ("failure", "eviction")]
    if not failures or (last_done is not None and max(failures) <= last_done):
        return None
    began = min(t for t in failures if last_done is None or t > last_done)
    decided = [e for e in before if e["time"] >= began and "resume_step" in e]
    return decided[-1]["resume_step"] if decided else None


class _MemorySampler:
    """Resident memory of every live actor process of the cluster, every MEMORY_EVERY_S seconds, and which
    of them are the job's workers then (a warm spare grows when it joins: that is not a leak)."""

    def __init__(self, seen_pids: set[int], members: Callable[[], set[int]]):
        self.seen_pids, self.members = seen_pids, members
        self.samples = []  # (seconds since the start, {pid: (class, rss)}, the job's worker pids)
        self.started = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._done.wait(MEMORY_EVERY_S):
            self._sample()

    def _sample(self) -> None:
        import psutil
        from ray.util.state import list_actors

        from baige_ray.api.connection import state_api_address

        members = self.members()
        rss = {}
        for actor in list_actors(address=state_api_address(), filters=[("state", "=", "ALIVE")], limit=10_000):
            try:
                rss[actor.pid] = (actor.class_name, psutil.Process(actor.pid).memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self.seen_pids.update(rss)
        self.samples.append((time.monotonic() - self.started, rss, members))

    def growth(self, from_s: float) -> dict[str, Any]:
        return memory_growth(self.samples, from_s)


def _still_alive(pids: set[int], wait_s: float = 15.0) -> list[int]:
    """The processes among `pids` still alive `wait_s` after the cluster shut down."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [pid for pid in sorted(pids) if process_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


# ----- the figures --------------------------------------------------------------------------------------


def _summary(soak: dict[str, Any], clean_losses: dict[int, float], args) -> dict[str, Any]:
    per_kind = {kind: _kind_figures([f for f in soak["faults"] if f["kind"] == kind]) for kind in FAULT_KINDS}
    for fault in soak["faults"]:
        if (throttle := fault.pop("throttle", None)) is not None:
            fault["process_gone_at"] = throttle.gone_at  # where a straggler's worker went, for the reader
    common = sorted(set(soak["losses"]) & set(clean_losses))
    last = common[-1]
    requests = soak["requests"]
    failed = [r for r in requests if r["latency_s"] is None]
    on_killed = [r for r in failed if any(r["sent_at"] <= kill <= (r["finished_at"] or float("inf"))
                                          for kill in soak["replica_kills_s"])]
    growth = soak["memory"]["growth"]

    def most_lost(kinds: tuple[str, ...]) -> int:
        return max([f["steps_lost"] or 0 for f in soak["faults"] if f["kind"] in kinds] or [0])

    return {
        "minutes": args.minutes, "seed": args.seed,
        "faults_injected": len(soak["faults"]),
        "faults_recovered": sum(f["recovered_s"] is not None for f in soak["faults"]),
        "max_steps_lost": most_lost(PROCESS_FAULTS), "max_steps_lost_node": most_lost(("node_loss",)),
        "max_steps_lost_checkpoint": most_lost(("checkpoint_corrupt",)),
        "per_kind": per_kind,
        "requests": len(requests), "failed_requests_on_killed_replicas": len(on_killed),
        "failed_requests_other": len(failed) - len(on_killed),
        "failed_statuses": dict(Counter(str(r["status"]) for r in failed)),  # 0: no answer (timeout, refused)
        "failed_reasons": dict(Counter(f"{r['status']}: {r['reason']}" for r in failed).most_common(5)),
        "failed_by_minute": dict(sorted(Counter(int(r["sent_at"] // 60) for r in failed).items())),  # when sent
        "slo_attainment": sum(r["latency_s"] is not None and r["latency_s"] <= args.slo_s for r in requests)
        / max(1, len(requests)),
        "steps": soak["steps_done"], "final_loss": soak["losses"][last], "fault_free_final_loss": clean_losses[last],
        "loss_rel_diff": abs(soak["losses"][last] - clean_losses[last]) / abs(clean_losses[last]),
        "loss_max_rel_diff": max(abs(soak["losses"][s] - clean_losses[s]) / abs(clean_losses[s]) for s in common),
        "rss_growth": max(growth.values(), default=0.0), "rss_growth_per_process": growth,
        "rss_window_s": [soak["memory"]["from_s"], soak["memory"]["to_s"]],
        "rss_timeline_mib": soak["memory"]["timeline_mib"],
        "left_behind": soak["left_behind"], "replica_capacity": round(soak["replica_capacity"], 2),
        "spike_rate": round(soak["spike_rate"], 2), "lends_s": soak["lends"], "reclaims_s": soak["reclaims"],
        "faults": soak["faults"], "not_injected": soak["not_injected"],
    }


def _kind_figures(faults: list[dict]) -> dict[str, Any]:
    detected = [f["detected_s"] for f in faults if f["detected_s"] is not None]
    recovered = [f["recovered_s"] for f in faults if f["recovered_s"] is not None]

    def p50_max(values: list[float]) -> list[float] | None:
        return [round(statistics.median(values), 3), round(max(values), 3)] if values else None

    return {"injected": len(faults), "detected": len(detected), "recovered": len(recovered),
            "detection_s": p50_max(detected), "recovery_s": p50_max(recovered),
            "steps_lost": [f["steps_lost"] for f in faults]}


def summarize(result: dict[str, Any]) -> str:
    lines = [f"soak of {result['minutes']:g} min (seed {result['seed']}): {result['faults_injected']} faults, "
             f"{result['faults_recovered']} recovered; steps lost at most {result['max_steps_lost']} per process "
             f"fault, {result['max_steps_lost_node']} per node loss, {result['max_steps_lost_checkpoint']} per "
             f"corrupted checkpoint (restored from the one before)"]
    for kind, figures in result["per_kind"].items():
        lines.append(f"  {kind:<14} injected {figures['injected']}, detected {figures['detected']}, recovered "
                     f"{figures['recovered']}, detection p50/max {figures['detection_s']} s, recovery "
                     f"{figures['recovery_s']} s, steps lost {figures['steps_lost']}")
    lines += [f"requests {result['requests']}: failed in flight on a killed replica "
              f"{result['failed_requests_on_killed_replicas']}, other {result['failed_requests_other']}; "
              f"within the SLO {result['slo_attainment']:.3f}; spikes at {result['spike_rate']} requests/s (a "
              f"replica answers {result['replica_capacity']}): lends took {result['lends_s']} s, reclaims "
              f"{result['reclaims_s']} s",
              f"{result['steps']} steps: final loss {result['final_loss']:.6f} against "
              f"{result['fault_free_final_loss']:.6f} "
              f"fault-free (relative {result['loss_rel_diff']:.2e})",
              f"resident memory growth, largest {result['rss_growth']:+.1%} over {result['rss_window_s']} s; "
              f"processes left behind: {result['left_behind'] or 'none'}"]
    return "\n".join(lines)
