"""bench scale's elastic part: the model as an elastic job (`launch`) whose workers snapshot their own
shards after every step, and one worker killed with SIGKILL in the middle of a step.

It reports what the snapshots cost (the stall they add to a step, their bytes in node shared memory)
and what the kill cost (seconds to notice it and to recover, steps redone), and the loss curve
against `fit`'s fault-free run of the same model, data and seed (which the elastic engines reproduce
exactly when nothing fails).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

POLL_S = 0.5


def measure_elastic(job, layout, args, storage: Path, reference_losses: list[float]) -> dict[str, Any]:
    """`job` (a TrainJob) trained in `layout` as an elastic job on a fresh local Ray."""
    import ray

    # Ray kills workers above 95% of the node's memory by default, a margin for shared hosts; this one
    # runs nothing else, and a recovery briefly holds the dead worker's shards beside two rebuilt engines.
    os.environ.setdefault("RAY_memory_usage_threshold", "0.98")
    ray.init(address="local", num_cpus=2, logging_level="WARNING", include_dashboard=False)
    try:
        return _run_and_kill(job, layout, args, storage, reference_losses)
    finally:
        ray.shutdown()


def _run_and_kill(job, layout, args, storage: Path, reference_losses: list[float]) -> dict[str, Any]:
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.api.elastic import ElasticConfig
    from baige_ray.jobs.launch import launch

    run = RunConfig(name=f"scale-elastic-{layout.data_parallel}", storage_path=storage, show_progress=False)
    # One snapshot slot: two do not fit beside two workers of this model in 24 GiB (the memory check
    # prices them); a kill while a worker copies (a few percent of a step) then falls back further.
    elastic = ElasticConfig(snapshot_slots=1, replicate_every=0, first_steps_timeout_s=1800,
                            persist_every=args.persist_every, persist_path=storage / "checkpoints", keep_checkpoints=1)
    handle = launch(job.model, data=job.data, train=job.train, layout=layout, run=run, elastic=elastic,
                    scaling=ScalingConfig(num_workers=2, accelerator="cpu", placement_timeout_s=900,
                                          host_allocator=args.host_allocator))
    kill = _kill_mid_step(handle, args.kill_step) if args.kill_step >= 0 else _shelf_bytes_at(handle, 1)
    result = handle.wait()
    events = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines() if line]
    report = _report(result, events, kill, reference_losses, args.warmup)
    report.update(_persistence(events, storage / "plain"))
    return report


def _after_kill(failure: dict | None, kill: dict, phases: dict) -> float | None:
    if failure is None or "regrouped" not in phases or "detected" not in phases:
        return None
    return round(failure["time"] - kill["time"] + phases["regrouped"] - phases["detected"], 3)


def _persistence(events: list[dict], scratch: Path) -> dict[str, Any]:
    """The fastest sharded checkpoint the run wrote (bytes over the slowest rank's seconds, written beside
    training), against one plain sequential write of as many bytes to the same disk, fsynced, after it."""
    persisted = [e for e in events if e["kind"] == "checkpoint" and "bytes" in e]
    if not persisted:
        failed = [e["reason"] for e in events if e["kind"] == "checkpoint"]
        return {"persist_vs_write": None, "persist_note": failed[-1] if failed else "no checkpoint was due"}
    best = min(persisted, key=lambda e: e["seconds"] / e["bytes"])
    plain_s = _plain_write_s(scratch, best["bytes"])
    return {"persisted_gb": round(best["bytes"] / 1e9, 3), "persist_s": best["seconds"],
            "persist_gbps": round(best["bytes"] / best["seconds"] / 1e9, 3), "checkpoints_written": len(persisted),
            "write_s": round(plain_s, 3), "write_gbps": round(best["bytes"] / plain_s / 1e9, 3),
            "persist_vs_write": round(plain_s / best["seconds"], 3)}


def _plain_write_s(directory: Path, nbytes: int, chunk_bytes: int = 64 << 20) -> float:
    """Seconds to write `nbytes` into one new file in big sequential writes, then fsync it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "plain.bin"
    chunk = os.urandom(chunk_bytes)
    started = time.perf_counter()
    with path.open("wb") as handle:
        left = nbytes
        while left > 0:
            left -= handle.write(memoryview(chunk)[:min(left, chunk_bytes)])
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def _wait_for_step(handle, step: int) -> dict[str, Any]:
    """The job's status once `step` has begun."""
    while (status := handle.status())["step"] < step:
        time.sleep(POLL_S)
    return status


def _shelf_bytes(run_name: str) -> int:
    """What the run's snapshot shelves hold in node shared memory now."""
    from baige_ray.elastic.shelf import run_shelves

    shelves = run_shelves(run_name)
    return sum(f.stat().st_size for f in shelves.rglob("*.bin")) if shelves.exists() else 0


def _shelf_bytes_at(handle, step: int) -> dict[str, Any]:
    """No kill: the snapshots' bytes once `step` has begun (every worker has taken one by then)."""
    status = _wait_for_step(handle, step)
    return {"step": None, "time": None, "pid": None, "shelf_bytes": _shelf_bytes(status["name"])}


def _kill_mid_step(handle, step: int) -> dict[str, Any]:
    """Wait until `step` has run for half a step, then SIGKILL the worker of rank 1."""
    status = _wait_for_step(handle, step)
    time.sleep(1 / status["steps_per_s"] / 2 if status["steps_per_s"] else 0.0)
    shelf_bytes = _shelf_bytes(status["name"])
    victim = status["workers"][1]["pid"]
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    return {"step": handle.status()["step"], "time": killed_at, "pid": victim, "shelf_bytes": shelf_bytes}


def _report(result, events: list[dict], kill: dict, reference_losses: list[float], warmup: int) -> dict[str, Any]:
    steady = [m for m in result.metrics[warmup:] if m.step_time_s == m.step_time_s]  # no NaN (unreported)
    stalls = [m.snapshot_stall_s / m.step_time_s for m in steady if m.step_time_s > 0]
    failure = next((e for e in events if kill["time"] and e["kind"] == "failure" and e["time"] >= kill["time"]),
                   None)
    recovery = result.recoveries[0] if result.recoveries else {}
    losses = [m.loss for m in result.metrics]
    compared = min(len(losses), len(reference_losses))
    return {
        "steps": len(result.metrics),
        "step_s": round(statistics.median(m.step_time_s for m in steady), 3) if steady else None,
        "stall_frac": round(statistics.median(stalls), 4) if stalls else None,
        "stall_frac_max": round(max(stalls), 4) if stalls else None,
        "snapshot_bytes_per_worker": kill["shelf_bytes"] // 2,
        "snapshot_host_gb": round(kill["shelf_bytes"] / 1e9, 3),
        "peer_replica_bytes": 0,  # one node: a replica on another node has nowhere to go (replicate_every=0)
        "peak_gb_with_snapshots": round(max(m.peak_host_memory_gb for m in result.metrics), 3),
        "killed_step": kill["step"],
        "detection_s": round(failure["time"] - kill["time"], 3) if failure else None,
        "recovery_s": round(recovery["recovery_s"], 3) if recovery else None,
        "steps_lost": recovery.get("lost_steps"),
        "recovery_phases_s": recovery.get("phases_s"),
        # The phases count from the failed step's start: from the kill, the group is whole again after
        "regrouped_after_kill_s": _after_kill(failure, kill, recovery.get("phases_s") or {}),
        "losses": [round(x, 4) for x in losses],
        "loss_max_abs_diff": round(max(abs(a - b) for a, b in zip(losses[:compared], reference_losses)), 6)
        if compared else None,
    }
