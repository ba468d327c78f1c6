"""Recovery from a crashed worker: baige's elastic controller against Ray Train V2, same scenario, one run.

The scenario (DESIGN.md): 4 workers train an MLP 512-2048-512 by data-parallel
SGD, batch 64 per worker; rank 2's process dies at step 25.

- `baige`: `launch` with one warm spare. The controller sees the actor die, the
  survivors' collectives fail or time out, the spare takes rank 2, the group
  re-forms in the surviving processes and everyone restores the in-memory
  snapshot taken after step 24.
- `ray_train`: `TorchTrainer` with `FailureConfig(max_failures=1)`, checkpointing
  every `--ray-train-checkpoint-every` steps (the usual cadence: persisting every
  step would cost far more than it saves). On the failure Ray Train tears down the
  worker group, starts a new one and resumes from the last reported checkpoint.

recovery_s: from the moment step 25 began (the crash happens at its start) to the
completion of the next step; lost_steps: steps executed twice (the crashed step
included); per_step_s: the steady-state median step time of the same run.
"""

from __future__ import annotations

import argparse
from typing import Any

from baige_ray.bench.measure import steady_median

SIZES = (512, 2048, 512)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vs", choices=["ray-train", "none"], default="none", help="also run the baseline")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-per-worker", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--crash-rank", type=int, default=2)
    parser.add_argument("--crash-step", type=int, default=25)
    parser.add_argument("--ray-train-checkpoint-every", type=int, default=10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from baige_ray.bench.measure import bench_ray

    if not 0 <= args.crash_rank < args.workers or not 5 <= args.crash_step < args.steps - 2:
        raise ValueError("--crash-rank must be a rank and --crash-step between 5 and --steps - 3")
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="baige-bench-recovery-") as tmp, bench_ray(num_cpus=2 * args.workers + 2):
        result["baige"] = _run_baige(args, tmp)
        if args.vs == "ray-train":
            result["ray_train"] = _run_ray_train(args, tmp)
    if "ray_train" in result:
        result["speedup"] = round(result["ray_train"]["recovery_s"] / result["baige"]["recovery_s"], 2)
    result["scenario"] = {"workers": args.workers, "model": list(SIZES), "batch_per_worker": args.batch_per_worker,
                          "crash": {"rank": args.crash_rank, "step": args.crash_step}, "steps": args.steps}
    return result


def summarize(result: dict[str, Any]) -> str:
    lines = ["system      recovery_s  lost_steps  per_step_s"]
    for name in ("baige", "ray_train"):
        if name in result:
            row = result[name]
            lines.append(f"{name:<11} {row['recovery_s']:>10.2f} {row['lost_steps']:>11d} {row['per_step_s']:>11.4f}")
    if "speedup" in result:
        lines.append(f"baige recovers {result['speedup']:.1f}x faster")
    return "\n".join(lines)


def _train_config(args: argparse.Namespace):
    from baige_ray.api.configs import TrainConfig

    return TrainConfig(num_steps=args.steps, global_batch_size=args.batch_per_worker * args.workers,
                       learning_rate=0.05, min_learning_rate=0.05, warmup_steps=0, grad_clip=0.0)


def _run_baige(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.api.elastic import ElasticConfig
    from baige_ray.elastic.faults import FaultPlan
    from baige_ray.jobs.launch import launch
    from baige_ray.models.mlp import MLPConfig

    job = launch(
        MLPConfig(sizes=SIZES),
        train=_train_config(args),
        scaling=ScalingConfig(num_workers=args.workers, accelerator="cpu", cpus_per_worker=1),
        run=RunConfig(name="bench-recovery", storage_path=tmp, show_progress=False),
        elastic=ElasticConfig(num_spares=1),
        faults=FaultPlan().crash(rank=args.crash_rank, step=args.crash_step),
    )
    result = job.wait()
    if len(result.recoveries) != 1:
        raise RuntimeError(f"expected one recovery, saw {result.recoveries}")
    recovery = result.recoveries[0]
    times = [m.step_time_s for m in result.metrics if m.step != args.crash_step]
    return {"recovery_s": round(recovery["recovery_s"], 3), "lost_steps": recovery["lost_steps"],
            "per_step_s": round(steady_median(times, 5), 4), "phases_s": recovery.get("phases_s", {}),
            "regroup_parts_s": recovery.get("regroup_parts_s", {})}


def _ray_train_loop(config: dict) -> None:
    import json
    import os
    import tempfile
    import time
    from pathlib import Path

    import ray.train
    import torch
    import torch.distributed as dist
    from torch import nn

    from baige_ray.engines.train_job import sample_range
    from baige_ray.models.mlp import MLP, MLPConfig, regression_batch

    torch.set_num_threads(1)
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    marks = Path(config["marks"])
    attempt = 2 if (marks / "crashed").exists() else 1
    torch.manual_seed(0)
    mlp_config = MLPConfig(sizes=tuple(config["sizes"]))
    model = nn.parallel.DistributedDataParallel(MLP(mlp_config))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=mlp_config.momentum, foreach=False)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            saved = torch.load(Path(directory, "state.pt"), weights_only=True)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = int(saved["step"]) + 1
    for step in range(start, config["steps"]):
        if rank == config["crash_rank"] and step == config["crash_step"] and not (marks / "crashed").exists():
            (marks / "crashed").write_text(json.dumps({"time": time.time()}))
            os._exit(17)
        started = time.time()
        inputs, targets = regression_batch(mlp_config, sample_range(step, rank, world, config["global_batch"]), 0)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if rank == 0:
            with open(marks / "steps.jsonl", "a") as log:
                log.write(json.dumps({"step": step, "start": started, "end": time.time(), "attempt": attempt}) + "\n")
        if (step + 1) % config["checkpoint_every"] == 0:
            with tempfile.TemporaryDirectory() as directory:
                if rank == 0:
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                    torch.save(state, Path(directory, "state.pt"))
                ray.train.report({"step": step},
                                 checkpoint=ray.train.Checkpoint.from_directory(directory) if rank == 0 else None)


def _run_ray_train(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    import json
    import os
    from pathlib import Path

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    marks = Path(tmp, "ray-train-marks")
    marks.mkdir()
    config = {"sizes": list(SIZES), "steps": args.steps, "crash_rank": args.crash_rank, "crash_step": args.crash_step,
              "global_batch": args.batch_per_worker * args.workers, "checkpoint_every": args.ray_train_checkpoint_every,
              "marks": str(marks)}
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name="recovery-ray-train", storage_path=str(Path(tmp, "ray-train")),
                             failure_config=FailureConfig(max_failures=1)),
    )
    result = trainer.fit()
    if result.error is not None:
        raise RuntimeError(f"Ray Train run failed: {result.error}")
    crashed_at = json.loads((marks / "crashed").read_text())["time"]
    steps = [json.loads(line) for line in (marks / "steps.jsonl").read_text().splitlines()]
    return recovery_figures(steps, crashed_at, args.crash_step)


def recovery_figures(steps: list[dict], crashed_at: float, crash_step: int) -> dict[str, Any]:
    """From per-step {step, start, end, attempt} records of one run with one crash at `crash_step`.

    The first attempt's steps may finish a moment after the crash (rank 0 logs after the
    crashed rank started its next step); recovery ends with the restarted attempt's first step.
    """
    after = [record for record in steps if record["attempt"] > 1]
    before = [record for record in steps if record["attempt"] == 1]
    if not after:
        raise RuntimeError("no step completed after the crash")
    resumed = after[0]
    durations = [record["end"] - record["start"] for record in before[1:]]
    return {"recovery_s": round(resumed["end"] - crashed_at, 3), "lost_steps": crash_step - resumed["step"] + 1,
            "per_step_s": round(steady_median(durations, min(5, len(durations) - 1)), 4)}
