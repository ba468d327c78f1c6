"""Step time of `fit` (DDP, 4 workers) against plain torchrun DDP and Ray Train V2, same model and batch.

All of them train the same model (the reference GPT, or with `--model llama-tiny` a Llama-architecture
`transformers` model with a locally trained tokenizer and TokenDataset, models/hf/tiny.py) with the same
global batch, seed, optimizer, schedule and gradient clipping, on gloo, one intra-op thread per process:

- `torchrun`: `python -m torch.distributed.run --standalone --nproc_per_node N -m
  baige_ray.bench.torchrun_ddp` (a plain DDP loop; rank 0 times each step), with no Ray running;
- `torchrun_beside_ray`: the same command while the Ray session baige uses is up and idle, as on a
  node of a Ray cluster: vs_torchrun_beside_ray is baige's own machinery, the cost of
  Ray's processes taken out;
- `baige`: `fit` with ParallelLayout(dp=N) (DDP); each worker times its steps from the end of the one
  before, and a step's time is the mean over the ranks;
- `ray_train`: `ray.train.torch.TorchTrainer` with ScalingConfig(num_workers=N) running the same loop
  as torchrun; rank 0 times each step. `ray.train.report` waits at a barrier of all workers (about 2 s
  a call here), so, as a competent user would, the loop reports once, after the timed steps.

The systems run one after another in `--rounds` rounds; torchrun runs alone, baige and
torchrun_beside_ray in one local Ray session, Ray Train in another (each started and stopped around
them, since Ray Train leaves actors behind, and left idle `--settle-s` before the first run in it).
The machine's speed drifts by tens of percent over minutes (a shared VM), so odd rounds run the same
segments in reverse order (ABBA): a drift that is linear over a pair of rounds then weighs on torchrun
and baige alike. Within a round, a system's step time is the median of its steady steps (the first
`--warmup` left out); a round's ratio compares two systems that ran a minute apart, and vs_x, the
headline, is the geometric mean of the rounds' baige/x ratios. `pooled` keeps the ratio of the medians
over every round's steady steps, `rounds` each round's.

On a machine whose cores the workers fill (4 one-thread workers on 2 cores here), the CPU Ray's own
processes take (GCS, raylet, dashboard, log monitor) comes out of the workers' time; `ray_daemon_cores`
is what they used during baige's runs, in cores, next to `cpu_count`. `ray_session_slowdown` is what
an idle Ray session costs a job that does not use it (torchrun_beside_ray over torchrun, geometric mean
over rounds): vs_torchrun is about it times vs_torchrun_beside_ray.
"""

from __future__ import annotations

import argparse
from typing import Any

from baige_ray.api.configs import HOST_ALLOCATORS
from baige_ray.bench.measure import report_stage, steady_median

SYSTEMS = ("torchrun", "torchrun_beside_ray", "baige", "ray_train")
BASELINES = tuple(name for name in SYSTEMS if name != "baige")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--host-allocator", default="cached", choices=HOST_ALLOCATORS,
                        help="the host allocator every system's processes start with (engines/host_allocator.py)")
    parser.add_argument("--model", choices=["gpt", "llama-tiny"], default="gpt",
                        help="the reference GPT (sized by the flags below) or a tiny Hugging Face Llama")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8, help="steps of each round left out of the steady state")
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="seconds a new Ray session is left idle before the first system in it runs")
    parser.add_argument("--rounds", type=int, default=4,
                        help="times every system runs, interleaved; odd rounds in reverse order (even counts cancel drift)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS),
                        help="which systems to run (torchrun outside Ray, the others in local Ray sessions)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os
    import tempfile
    import time
    from pathlib import Path

    from baige_ray.bench.measure import HelperCpu, bench_ray
    from baige_ray.bench.torchrun_ddp import DDPSettings
    from baige_ray.engines.host_allocator import allocator_env_vars

    if args.steps <= args.warmup:
        raise ValueError(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds} is invalid: expected >= 1")
    if args.settle_s < 0:
        raise ValueError(f"--settle-s={args.settle_s} is invalid: expected >= 0")
    settings = DDPSettings(
        model={"num_layers": args.num_layers, "hidden": args.hidden, "num_heads": args.num_heads,
               "seq_len": args.seq_len},
        num_steps=args.steps, global_batch_size=args.global_batch_size, host_allocator=args.host_allocator,
    )
    runners = {"torchrun": _run_torchrun, "torchrun_beside_ray": _run_torchrun, "baige": _run_baige,
               "ray_train": _run_ray_train}
    times: dict[str, list[list[float]]] = {name: [] for name in args.systems}
    wall: dict[str, float] = dict.fromkeys(args.systems, 0.0)
    daemon_cores: list[float] = []
    crashes: list[str] = []

    def run_system(name: str, tmp: str) -> None:
        system_started = time.perf_counter()
        helpers = HelperCpu() if name == "baige" else None  # the session's daemons, already running
        # A directory per run: Ray Train would otherwise resume from the previous round's run snapshot.
        storage = tempfile.mkdtemp(prefix=f"{name}-", dir=tmp)
        try:
            step_times = runners[name](settings, args.workers, storage)
        except TorchrunCrashed as crash:  # a baseline process that died is run again, and said so
            crashes.append(f"{name}: {str(crash).splitlines()[0]}")
            step_times = runners[name](settings, args.workers, tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
        times[name].append(step_times)
        if helpers is not None:
            daemon_cores.append(helpers.cores())
        wall[name] += time.perf_counter() - system_started

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="baige-bench-overhead-") as tmp:
        if args.model == "llama-tiny":
            settings = _llama_tiny_settings(settings, Path(tmp), args.seq_len)
        for index in range(args.rounds):
            report_stage(args, "rounds of every system", index, args.rounds)
            for segment in round_segments(index, args.systems):
                if segment == ["torchrun"]:
                    run_system("torchrun", tmp)
                    continue
                with bench_ray(num_cpus=2 * args.workers, env_vars=allocator_env_vars(args.host_allocator)):
                    time.sleep(args.settle_s)  # a new session's start-up work is over before a system is timed
                    for name in segment:
                        run_system(name, tmp)
    systems = {name: _summary(rounds, args.warmup, wall[name]) for name, rounds in times.items()}
    result: dict[str, Any] = {f"{name}_step_s": round(row["step_s"], 5) for name, row in systems.items()}
    per_round = round_ratios(times, args.warmup)
    for key in (f"vs_{name}" for name in BASELINES):
        if per_round and key in per_round[0]:
            result[key] = round(geometric_mean([row[key] for row in per_round]), 4)
    slowdown = ray_session_slowdown(times, args.warmup)
    result["ray_session_slowdown"] = round(slowdown, 4) if slowdown is not None else None
    result.update(
        workers=args.workers, model=args.model if args.model != "gpt" else settings.model,
        global_batch_size=settings.global_batch_size, steps=args.steps, warmup=args.warmup,
        cpu_count=os.cpu_count(),
        ray_daemon_cores=round(sum(daemon_cores) / len(daemon_cores), 4) if daemon_cores else None,
        pooled=pooled_ratios(systems), rounds=per_round, baseline_crashes=crashes, systems=systems,
        bench_s=round(time.perf_counter() - started, 1),
    )
    return result


def round_segments(index: int, systems: list[str]) -> list[list[str]]:
    """What round `index` runs, in order; a segment other than torchrun's runs in a Ray session of its
    own (Ray Train leaves actors behind that would take CPU from what follows). Odd rounds run the
    reverse (ABBA), and baige always runs next to torchrun and to torchrun_beside_ray."""
    baige = [name for name in ("torchrun_beside_ray", "baige") if name in systems]
    segments = [["torchrun"]] if "torchrun" in systems else []
    segments += [baige] if baige else []
    segments += [["ray_train"]] if "ray_train" in systems else []
    if index % 2 == 1:
        return [list(reversed(segment)) for segment in reversed(segments)]
    return segments


def geometric_mean(values: list[float]) -> float:
    import math

    if not values or min(values) <= 0:
        raise ValueError(f"geometric mean of {values}: expected positive values")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def pooled_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """baige's median over every round's steady steps, over each other system's."""
    if "baige" not in systems:
        return {}
    return {f"vs_{other}": round(systems["baige"]["step_s"] / systems[other]["step_s"], 4)
            for other in BASELINES if other in systems}


def round_ratios(times: dict[str, list[list[float]]], warmup: int) -> list[dict[str, float]]:
    """Per round: baige's median steady step over each other system's."""
    if "baige" not in times:
        return []
    rows = []
    for index, baige in enumerate(times["baige"]):
        row = {}
        for other in BASELINES:
            if other in times:
                row[f"vs_{other}"] = round(steady_median(baige, warmup) / steady_median(times[other][index], warmup), 4)
        rows.append(row)
    return rows


def ray_session_slowdown(times: dict[str, list[list[float]]], warmup: int) -> float | None:
    """Geometric mean over rounds of torchrun's median steady step beside an idle Ray session over
    its own without Ray; None unless both ran."""
    if "torchrun" not in times or "torchrun_beside_ray" not in times:
        return None
    return geometric_mean([steady_median(beside, warmup) / steady_median(alone, warmup)
                           for beside, alone in zip(times["torchrun_beside_ray"], times["torchrun"], strict=True)])


def _llama_tiny_settings(settings, directory, seq_len: int):
    import dataclasses

    from baige_ray.models.hf.tiny import make_llama_tiny

    model, dataset = make_llama_tiny(directory / "llama-tiny", seq_len=seq_len)
    return dataclasses.replace(settings, model={}, hf_model_dir=str(model.path), dataset_dir=str(dataset.directory))


def _summary(rounds: list[list[float]], warmup: int, wall_s: float) -> dict[str, Any]:
    import statistics

    steady = [t for times in rounds for t in times[warmup:]]  # run() checked that steps exceed warmup
    return {
        "step_s": statistics.median(steady),
        "step_times_s": [[round(t, 4) for t in times] for times in rounds],
        "wall_s": round(wall_s, 1),
    }


def summarize(result: dict[str, Any]) -> str:
    lines = ["system      median_step_s   wall_s"]
    for name, row in result["systems"].items():
        lines.append(f"{name:<11} {row['step_s']:>13.4f} {row['wall_s']:>8.1f}")
    ratios = [f"{key} = {result[key]:.3f}" for key in (f"vs_{name}" for name in BASELINES) if key in result]
    if ratios:
        lines.append("baige step time / baseline (geometric mean over rounds): " + ", ".join(ratios))
    if result["ray_session_slowdown"] is not None:
        lines.append(f"torchrun beside an idle Ray session / torchrun alone: {result['ray_session_slowdown']:.3f}")
    if result["ray_daemon_cores"] is not None:
        lines.append(f"Ray's own processes during baige's runs: {result['ray_daemon_cores']:.3f} of "
                     f"{result['cpu_count']} cores")
    for crash in result["baseline_crashes"]:
        lines.append(f"run again after a crash: {crash}")
    for index, row in enumerate(result["rounds"], start=1):
        lines.append(f"round {index}: " + ", ".join(f"{key} = {value:.3f}" for key, value in row.items()))
    return "\n".join(lines)


class TorchrunCrashed(RuntimeError):
    """A torchrun baseline run whose processes died (e.g. gloo aborting in its rendezvous)."""


def _run_torchrun(settings, workers: int, tmp: str) -> list[float]:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from baige_ray.engines.host_allocator import allocator_env_vars

    out = Path(tmp) / "torchrun.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
        "-m", "baige_ray.bench.torchrun_ddp", "--settings", settings.to_json(), "--out", str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(settings.num_threads), **allocator_env_vars(settings.host_allocator)}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if completed.returncode != 0:
        raise TorchrunCrashed(f"exited with {completed.returncode}\n{completed.stderr[-4000:]}")
    return json.loads(out.read_text())["step_times_s"]


def _run_baige(settings, workers: int, tmp: str) -> list[float]:
    from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
    from baige_ray.jobs.fit import fit
    from baige_ray.models.corpus import CorpusConfig
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.parallel.layout import ParallelLayout

    if settings.hf_model_dir is not None:
        from baige_ray.models.hf import HFModel
        from baige_ray.models.token_dataset import TokenDataset

        dataset = TokenDataset.open(settings.dataset_dir)
        model, data = HFModel(settings.hf_model_dir, seq_len=dataset.seq_len), dataset
    else:
        model, data = GPTConfig(**settings.model), CorpusConfig(max_bytes=settings.corpus_max_bytes)
    result = fit(
        model,
        train=TrainConfig(num_steps=settings.num_steps, global_batch_size=settings.global_batch_size,
                          seed=settings.seed, log_every=1),
        scaling=ScalingConfig(num_workers=workers, accelerator="cpu", host_allocator=settings.host_allocator),
        run=RunConfig(name="overhead-baige", storage_path=tmp, show_progress=False),
        data=data,
        layout=ParallelLayout(dp=workers),
    )
    return [m.step_time_s for m in result.metrics]


def _ray_train_loop(config: dict) -> None:
    import json
    import tempfile
    from pathlib import Path

    import ray.train

    from baige_ray.bench.torchrun_ddp import DDPSettings, train_ddp

    times = train_ddp(DDPSettings.from_json(config["settings"]))
    # Ray Train V2 keeps only metrics that come with a checkpoint: rank 0 hands its step
    # times back with a one-file checkpoint, after the timed steps.
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report({"step_times_s": times})
        return
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "step_times.json").write_text(json.dumps(times))
        ray.train.report({"step_times_s": times}, checkpoint=ray.train.Checkpoint.from_directory(directory))


def _run_ray_train(settings, workers: int, tmp: str) -> list[float]:
    import os

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # the default in recent Ray; set before importing ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"settings": settings.to_json()},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name="overhead-ray-train", storage_path=tmp),
    )
    result = trainer.fit()
    if result.error is not None:
        raise RuntimeError(f"Ray Train run failed: {result.error}")
    return list(result.metrics["step_times_s"])
