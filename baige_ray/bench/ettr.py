"""Effective training time at 1,024 / 16,384 / 100,000 devices: baige-ray's recovery against restarting.

A discrete-event simulation (bench/ettr_sim.py) of `--days` of training per size and seed:
faults drawn at the per-device rates and kinds Llama 3 405B's pre-training logged on 16,384
H100s (examples/models/published-failures.yaml), each costing what a recovery strategy costs.

* The job at each size is what the planner picks for GPT-175B (examples/models/gpt-175b.yaml)
  on the H100 rail-optimized descriptor sized to it (as `bench plan`): its step time from the
  cost model, the state a device holds (weights and Adam state under its ZeRO stage).
* baige-ray's phases are measured here, in the same run (`--no-measure` takes the figures of
  RECORDED instead): an elastic job with a warm spare whose worker is SIGKILLed, then frozen
  (SIGSTOP): detection, and the rest of the recovery up to the group re-formed with its state.
* The restart baseline (Ray Train, torchrun): a checkpoint to storage every 30 minutes
  (training stops while it is written), and on any fault the whole job restarts from it; its
  restart is measured here too, as `bench recovery --vs ray-train` runs it.
* Assumed, not measured (each a flag): how regrouping and restarting grow with the number of
  ranks (with log2 of it: tree-based bootstrap), storage bandwidth per device, the bandwidth a
  replacement pulls a peer's copy at (a rail NIC), node repair time, spare nodes, how long
  silent corruption goes unnoticed.

Reported per size: ETTR of both (mean over seeds), faults by scope, where the time went.
`ettr_16k` and `baseline_ettr_16k` (the restart) are the 16,384-device figures.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

import yaml

from baige_ray.catalog import PUBLISHED_PACKAGE, shipped_file

FAILURES_PATH = shipped_file(PUBLISHED_PACKAGE, "published-failures.yaml")
MODEL_PATH = shipped_file(PUBLISHED_PACKAGE, "gpt-175b.yaml")
SIZES = (1024, 16384, 100000)
DEVICES_PER_NODE = 8  # an HGX H100 node of the descriptor
GB = 1e9

# What `--no-measure` uses: `bench ettr`'s own measurement on the 2-core machine, 2026-11-25 (bench
# recovery's scenario: 4 workers, MLP 512-2048-512), and bench scale's figures for the 494M model: its
# sharded restore (3.3 GB per rank in 1.4 s) and snapshot stall (under 0.01% of a step; 1e-4 taken).
RECORDED = {"detect_crash_s": 0.268, "detect_hang_s": 2.262, "regroup_s": 1.045, "workers": 4,
            "restart_s": 9.157, "local_restore_gb_per_s": 2.36, "stall_fraction": 1e-4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--days", type=float, default=54.0, help="simulated wall time per run (Llama 3's window)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--no-measure", action="store_true",
                        help="take baige-ray's and the baseline's phases from RECORDED instead of measuring them")
    parser.add_argument("--spare-fraction", type=float, default=0.01, help="warm spare nodes per training node")
    parser.add_argument("--persist-minutes", type=float, default=10.0,
                        help="baige-ray's persisted-checkpoint interval (written beside training, so it can be "
                             "shorter than the baseline's: 10 minutes of a 5.6 GB device state is 9 MB/s)")
    parser.add_argument("--checkpoint-minutes", type=float, default=30.0, help="the baseline's checkpoint interval")
    parser.add_argument("--repair-hours", type=float, default=8.0, help="assumed: a failed node back in the pool")
    parser.add_argument("--storage-gb-per-s", type=float, default=0.5,
                        help="assumed: checkpoint storage bandwidth per device, read and write")
    parser.add_argument("--peer-gb-per-s", type=float, default=50.0,
                        help="assumed: a replacement pulling a peer node's copy (one 400 Gbit/s rail NIC)")
    parser.add_argument("--corruption-detect-minutes", type=float, default=10.0,
                        help="assumed: silent data corruption goes unnoticed this long")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from baige_ray.bench.measure import report_stage

    kinds, source = load_failures()
    phases = dict(RECORDED, measured=False)
    if not args.no_measure:
        report_stage(args, "measuring recovery phases", 0, 1)
        phases = measure_phases()
    rows = []
    for index, devices in enumerate(args.sizes):
        report_stage(args, f"simulating {devices} devices", index, len(args.sizes))
        rows.append(_size_row(args, kinds, phases, devices, source["baseline_hang_timeout_s"]))
    result: dict[str, Any] = {"sizes": rows, "phases": phases, "assumed": _assumptions(args),
                              "failures": {"source": source["title"], "arxiv": source["arxiv"],
                                           "per_device_hour": sum(k.per_device_hour for k in kinds)}}
    by_size = {row["devices"]: row for row in rows}
    if 16384 in by_size:
        result["ettr_16k"] = by_size[16384]["baige_ray"]["ettr"]
        result["baseline_ettr_16k"] = by_size[16384]["restart"]["ettr"]
    return result


def summarize(result: dict[str, Any]) -> str:
    lines = [f"faults: {result['failures']['source']} (arXiv {result['failures']['arxiv']}), "
             f"{result['failures']['per_device_hour']:.3g} per device-hour; phases "
             f"{'measured here' if result['phases']['measured'] else 'recorded'}",
             "devices   layout              faults  baige-ray ETTR  restart ETTR  (persisted restores)"]
    for row in result["sizes"]:
        ours, base = row["baige_ray"], row["restart"]
        lines.append(f"{row['devices']:>7}   {row['layout']:<18} {ours['faults']:>6.0f}  {ours['ettr']:>13.4f}  "
                     f"{base['ettr']:>12.4f}  ({ours['persisted_restores']:.1f})")
    return "\n".join(lines)


# ---- inputs ------------------------------------------------------------------------------------------


def load_failures(path: str | Path = FAILURES_PATH):
    """The fault classes of a published-failures YAML at per-device-hour rates, and its source block."""
    from baige_ray.bench.ettr_sim import FaultClass

    data = yaml.safe_load(Path(path).read_text())
    source = data["source"]
    device_hours = source["devices"] * source["days"] * 24.0
    kinds = [FaultClass(name=k["name"], per_device_hour=k["count"] / device_hours, scope=k["scope"],
                        hangs=bool(k["hangs"])) for k in data["kinds"]]
    if sum(k["count"] for k in data["kinds"]) != source["unexpected_interruptions"]:
        raise ValueError(f"{path}: the kinds' counts do not sum to unexpected_interruptions")
    source = dict(source, baseline_hang_timeout_s=float(data["baseline_hang_timeout_s"]))
    return kinds, source


def job_at(devices: int):
    """The planner's pick for GPT-175B on `devices` H100s, as an ettr_sim.Job."""
    import numpy as np

    from baige_ray.bench.ettr_sim import Job
    from baige_ray.bench.plan import h100_graph
    from baige_ray.planner.memory import optimizer_bytes_per_param, stage_param_counts
    from baige_ray.planner.model_spec import load_model_spec
    from baige_ray.planner.plan import plan

    model = load_model_spec(MODEL_PATH)
    chosen = plan(model, h100_graph(devices))
    dense, expert = stage_param_counts(model, np.asarray(chosen.stage_layers))
    params = float(np.max(dense + expert)) / chosen.tp
    optimizer = optimizer_bytes_per_param(model) / (chosen.dp if chosen.zero_stage >= 1 else 1)
    weights = model.dtype_bytes / (chosen.dp if chosen.zero_stage >= 3 else 1)
    whole_nodes = -(-chosen.num_ranks // DEVICES_PER_NODE) * DEVICES_PER_NODE
    job = Job(devices=whole_nodes, devices_per_node=DEVICES_PER_NODE, replica_devices=chosen.tp * chosen.pp,
              step_s=float(chosen.step_time_s), state_bytes=params * (optimizer + weights))
    return job, f"tp={chosen.tp} pp={chosen.pp} dp={chosen.dp} z{chosen.zero_stage}"


def strategies(args: argparse.Namespace, phases: dict[str, Any], devices: int, hang_timeout_s: float):
    from baige_ray.bench.ettr_sim import ElasticRecovery, RestartRecovery

    grow = scale_with_ranks(devices, phases["workers"])
    storage = args.storage_gb_per_s * GB
    local = phases["local_restore_gb_per_s"] * GB
    lag = args.corruption_detect_minutes * 60.0
    ours = ElasticRecovery(detect_crash_s=phases["detect_crash_s"], detect_hang_s=phases["detect_hang_s"],
                           regroup_s=phases["regroup_s"] * grow, local_restore_bytes_per_s=local,
                           peer_restore_bytes_per_s=min(local, args.peer_gb_per_s * GB),
                           storage_read_bytes_per_s=storage, persist_every_s=args.persist_minutes * 60.0,
                           stall_fraction=phases["stall_fraction"], corruption_detect_s=lag)
    restart = RestartRecovery(detect_crash_s=phases["detect_crash_s"], hang_timeout_s=hang_timeout_s,
                              restart_s=phases["restart_s"] * grow, storage_read_bytes_per_s=storage,
                              storage_write_bytes_per_s=storage, checkpoint_interval_s=args.checkpoint_minutes * 60.0,
                              corruption_detect_s=lag)
    return ours, restart


def scale_with_ranks(devices: int, measured_at: int) -> float:
    """Assumed: forming process groups grows with log2 of the ranks (tree-based bootstrap)."""
    return max(1.0, math.log2(devices) / math.log2(max(2, measured_at)))


def _size_row(args: argparse.Namespace, kinds, phases: dict[str, Any], devices: int,
              hang_timeout_s: float) -> dict[str, Any]:
    from baige_ray.bench.ettr_sim import fault_trace, simulate

    job, layout = job_at(devices)
    ours, restart = strategies(args, phases, job.devices, hang_timeout_s)
    hours = args.days * 24.0
    spares = max(1, round(args.spare_fraction * job.nodes))
    outcomes: dict[str, list] = {"baige_ray": [], "restart": []}
    for seed in range(args.seeds):
        trace = fault_trace(kinds, job.devices, hours, seed)
        for key, strategy in (("baige_ray", ours), ("restart", restart)):
            outcomes[key].append(simulate(strategy, job, trace, hours=hours, spare_nodes=spares,
                                          repair_s=args.repair_hours * 3600.0, seed=seed))
    row: dict[str, Any] = {"devices": job.devices, "layout": layout, "step_s": round(job.step_s, 3),
                           "state_gb_per_device": round(job.state_bytes / GB, 2), "spare_nodes": spares}
    for key, runs in outcomes.items():
        row[key] = _mean_outcome(runs)
    return row


def _mean_outcome(runs) -> dict[str, Any]:
    rows = [run.as_dict() for run in runs]
    numeric = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    mean = {k: round(statistics.fmean(r[k] for r in rows), 5 if k == "ettr" else 1) for k in numeric}
    mean["ettr_min"] = round(min(r["ettr"] for r in rows), 5)
    mean["by_scope"] = {scope: round(statistics.fmean(r["by_scope"].get(scope, 0) for r in rows), 1)
                        for scope in sorted({s for r in rows for s in r["by_scope"]})}
    return mean


def _assumptions(args: argparse.Namespace) -> dict[str, Any]:
    return {"regroup_and_restart_growth": "log2(ranks) / log2(measured ranks)",
            "storage_gb_per_s_per_device": args.storage_gb_per_s, "peer_gb_per_s": args.peer_gb_per_s,
            "repair_hours": args.repair_hours, "spare_fraction": args.spare_fraction,
            "corruption_detect_minutes": args.corruption_detect_minutes,
            "persist_minutes": args.persist_minutes, "checkpoint_minutes": args.checkpoint_minutes,
            "step_time": "the planner's cost model (uncalibrated, H100 descriptor)"}


# ---- measured phases -----------------------------------------------------------------------------------


def measure_phases(workers: int = 4) -> dict[str, Any]:
    """baige-ray's detection and regroup, from an elastic job whose worker is killed and later frozen,
    and Ray Train's restart from `bench recovery`'s scenario, both on a local Ray of this machine. The
    restore rate and the snapshot stall stay bench scale's (RECORDED): they need its 494M model."""
    import tempfile

    from baige_ray.bench import recovery
    from baige_ray.bench.measure import bench_ray

    scenario = argparse.Namespace(workers=workers, batch_per_worker=64, steps=40, crash_rank=2, crash_step=12,
                                  ray_train_checkpoint_every=10)
    with tempfile.TemporaryDirectory(prefix="baige-bench-ettr-") as tmp, bench_ray(num_cpus=2 * workers + 2):
        crash, hang = _elastic_recoveries(scenario, tmp)
        baseline = recovery._run_ray_train(scenario, tmp)
    detected = {"crash": crash["phases_s"]["detected"], "hang": hang["phases_s"]["detected"]}
    regroup = statistics.median(r["phases_s"]["regrouped"] - r["phases_s"]["detected"] for r in (crash, hang))
    restart = baseline["recovery_s"] - baseline["per_step_s"] - detected["crash"]
    return dict(RECORDED, measured=True, workers=workers, detect_crash_s=round(detected["crash"], 3),
                detect_hang_s=round(detected["hang"], 3), regroup_s=round(regroup, 3), restart_s=round(restart, 3),
                recorded=["local_restore_gb_per_s", "stall_fraction"])


def _elastic_recoveries(scenario: argparse.Namespace, tmp: str) -> tuple[dict, dict]:
    """The recoveries of one elastic job with a warm spare: a worker SIGKILLed, later another frozen."""
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.api.elastic import ElasticConfig
    from baige_ray.bench.recovery import SIZES, _train_config
    from baige_ray.elastic.faults import FaultPlan
    from baige_ray.jobs.launch import launch
    from baige_ray.models.mlp import MLPConfig

    job = launch(MLPConfig(sizes=SIZES), train=_train_config(scenario),
                 scaling=ScalingConfig(num_workers=scenario.workers, accelerator="cpu", cpus_per_worker=1),
                 run=RunConfig(name="bench-ettr", storage_path=tmp, show_progress=False),
                 elastic=ElasticConfig(num_spares=1),
                 faults=FaultPlan().crash(rank=scenario.crash_rank, step=scenario.crash_step)
                 .hang(rank=1, step=scenario.crash_step + 14))
    recoveries = job.wait().recoveries
    if len(recoveries) != 2:
        raise RuntimeError(f"expected two recoveries (a kill, a freeze), saw {recoveries}")
    return recoveries[0], recoveries[1]
