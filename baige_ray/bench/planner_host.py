"""The calibrated planner against what ran on one device of this machine (a GPU host's first GPU).

`bench planner` checks the planner's layouts on the simulated 8-device cluster; on one device the choice
left is the micro-batch, and on a GPU it is decided by how much a step pays for launching kernels, which
nominal constants do not price. This bench calibrates the device through a worker actor (`calibrate`,
NCCL on a GPU), predicts the one-device layout's step per micro-batch size with the calibration and
without it, then runs `fit` at each size and reports predicted against measured step time and memory.

By default it uses this machine: RAY_ADDRESS, else a local Ray with its GPUs, Qwen2.5-0.5B's published
configuration (fresh weights, as `bench scale` builds it), sequence 1024, global batch 8, bf16 mixed.
`--cluster DESCRIPTOR --tiny` runs the same on the first device of a simulated cluster with a
4-layer Llama, to try it where there is no GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from baige_ray.bench.measure import report_stage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--micro-batches", default="1,2,4,8", help="comma-separated sizes, each dividing the batch")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="steps per micro-batch size, warm-up included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "fp32"])
    parser.add_argument("--cluster", default=None, help="simulate this descriptor's first device instead")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer Llama (hidden 256) instead of Qwen2.5-0.5B")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "baige-bench-planner-host"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from baige_ray.topology.connect import open_cluster

    batches = [int(b) for b in args.micro_batches.split(",")]
    bad = [b for b in batches if b < 1 or args.global_batch % b]
    if bad:
        raise ValueError(f"--micro-batches={bad} is invalid: each must divide --global-batch={args.global_batch}")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    with open_cluster(args.cluster, local_num_gpus=_local_gpus(), log_to_driver=False):
        from baige_ray.runtime.auto_plan import first_devices, live_graph

        graph = live_graph()
        if graph.num_devices == 0:
            raise ValueError("this cluster's resource graph has no accelerators: run `bench planner-host` where a "
                             "GPU is, or try it with --cluster sim-2x4 --tiny")
        graph = first_devices(graph, 1)
        model, data, spec = _model(args, work)
        # Measured before calibrating, so no probe worker shares the device with the steps.
        measured = {}
        for index, b in enumerate(batches):
            report_stage(args, f"fit, micro-batch {b}", index, len(batches) + 1)
            measured[b] = _measure(model, data, b, args, work)
        report_stage(args, "calibrating", len(batches), len(batches) + 1)
        calibration, calibration_s = _calibrate(graph, model, spec, work)
    calibrated = predict_one_device(spec, graph, calibration, batches)
    nominal = predict_one_device(spec, graph, None, batches)
    rows = [{"micro_batch": b, "measured_s": measured[b]["step_s"], "predicted_s": calibrated[b]["step_s"],
             "nominal_s": nominal[b]["step_s"], "rel_error": calibrated[b]["step_s"] / measured[b]["step_s"] - 1.0,
             "peak_device_gb": measured[b]["peak_device_gb"], "predicted_memory_gb": calibrated[b]["memory_gb"]}
            for b in batches]
    return {"device": graph.profiles[0].chip_model, "model": spec.name, "seq_len": spec.seq_len,
            "global_batch": spec.global_batch, "precision": args.precision, **accuracy(rows),
            "calibration_s": calibration_s, "rows": rows, "steps": args.steps, "warmup": args.warmup}


def accuracy(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from baige_ray.bench.planner import spearman

    errors = np.abs([row["rel_error"] for row in rows])
    pick = min(rows, key=lambda r: r["predicted_s"])
    fastest = min(rows, key=lambda r: r["measured_s"])
    return {"median_rel_error": float(np.median(errors)), "max_rel_error": float(errors.max()),
            "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
            if len(rows) > 1 else float("nan"),
            "pick": pick["micro_batch"], "fastest": fastest["micro_batch"],
            "pick_vs_best": pick["measured_s"] / fastest["measured_s"]}


def summarize(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} on one {result['device']}, sequence {result['seq_len']}, batch "
             f"{result['global_batch']}, {result['precision']}; calibration {result['calibration_s']:.1f} s",
             "  b  measured_s  predicted_s   error  uncalibrated_s  peak / model GB"]
    for row in result["rows"]:
        peak = f"{row['peak_device_gb']:.1f}" if row["peak_device_gb"] else "-"
        lines.append(f"{row['micro_batch']:>3} {row['measured_s']:>11.3f} {row['predicted_s']:>12.3f} "
                     f"{row['rel_error']:>+7.1%} {row['nominal_s']:>15.3f}  {peak} / {row['predicted_memory_gb']:.1f}")
    lines.append(f"median |error| {result['median_rel_error']:.1%}, worst {result['max_rel_error']:.1%}, Spearman "
                 f"{result['spearman']:.2f}, pick {result['pick']} (fastest {result['fastest']})")
    return "\n".join(lines)


def predict_one_device(spec, graph, calibration, batches: list[int]) -> dict[int, dict[str, float]]:
    """Per micro-batch size: the planner's step seconds and worst-stage memory (GB) for the one-device layout."""
    from baige_ray.bench.planner import layout_and_context, micro_batch_rows, plan_options
    from baige_ray.planner.evaluate import evaluate
    from baige_ray.planner.search import Hardware

    options = plan_options(calibration)
    _, context = layout_and_context(spec, Hardware(graph, options), tp=1, pp=1, dp=1)
    evaluation = evaluate(spec, options.constants, context, micro_batch_rows(0, batches))
    return {b: {"step_s": float(step), "memory_gb": float(memory.max()) / 1e9}
            for b, step, memory in zip(batches, evaluation.step_s, evaluation.memory_bytes)}


def _local_gpus() -> int | None:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def _model(args, work: Path):
    """(model, dataset, ModelSpec in the precision the steps compute in)."""
    from baige_ray.api.configs import TrainConfig
    from baige_ray.engines.train_job import TrainJob

    if args.tiny:
        from baige_ray.bench.planner import LLAMA_SHAPE
        from baige_ray.models.hf.tiny import make_llama_tiny

        model, data = make_llama_tiny(work / "llama", shape=LLAMA_SHAPE, name="llama-256", seq_len=args.seq_len)
    else:
        from baige_ray.bench.scale import prepare
        from baige_ray.models.hf import HFModel
        from baige_ray.models.token_dataset import TokenDataset

        model_dir, data_dir = prepare(work, args.seq_len)
        data = TokenDataset.open(data_dir)
        model = HFModel(model_dir, seq_len=args.seq_len, tokenizer=model_dir.parent / "tokenizer")
    job = TrainJob(model=model, train=TrainConfig(num_steps=1, global_batch_size=args.global_batch, seed=0,
                                                  precision=args.precision), data=data)
    return model, data, job.plugin.model_spec(global_batch=args.global_batch,
                                              dtype_bytes=2 if args.precision == "bf16-mixed" else 4)


def _calibrate(graph, model, spec, work: Path) -> tuple[Any, float]:
    from baige_ray.jobs.calibrate import CalibrationRequest, calibrate

    request = CalibrationRequest(models=(spec,), model_configs={spec.name: model}, micro_batches=(1, 2, 4, 8))
    started = time.perf_counter()
    calibration = calibrate(graph, request, directory=work / "calibration", refresh=True)
    return calibration, time.perf_counter() - started


def _measure(model, data, micro_batch: int, args, work: Path) -> dict[str, Any]:
    from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
    from baige_ray.jobs.fit import fit
    from baige_ray.parallel.layout import ParallelLayout

    train = TrainConfig(num_steps=args.steps, global_batch_size=args.global_batch, seed=0, warmup_steps=0,
                        precision=args.precision,
                        micro_batch_size=None if micro_batch == args.global_batch else micro_batch)
    result = fit(model, train=train, scaling=ScalingConfig(num_workers=1),
                 run=RunConfig(name="bench-planner-host", storage_path=str(work / "runs"), show_progress=False),
                 data=data, layout=ParallelLayout(dp=1))
    steps = [m.step_time_s for m in result.metrics]
    peak = max(m.peak_device_memory_gb for m in result.metrics)
    return {"step_s": float(np.median(steps[args.warmup:])), "peak_device_gb": peak or None}
