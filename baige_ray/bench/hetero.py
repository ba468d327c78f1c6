"""Mixed chip speeds: a pipeline split in proportion to speed against the ideal sum of each chip alone.

Two workers emulate chips at relative speed 1.0 and 0.5 (`fit(emulated_speeds=...)`:
the slower one sleeps after each forward and each backward for as long again as that
work took, see `SlowChipEmulator`). The same GPT and global batch are trained four ways,
one after another in one Ray session:

- `planned`: PP=2 laid out by `plan_stages`: which chip holds which stage and how many
  layers, minimising the 1F1B step time with the LM head counted on the last stage. For
  6 layers at speeds 1.0 / 0.5 that is the slow chip first with 2 layers, the fast chip
  last with 4 layers and the head (4.0 and 4.08 layer-times per micro-batch; the other
  order, (4, 2), gives 4.0 and 4.15). Stage 0 runs `--run-ahead` forwards beyond 1F1B's,
  so when it is the slower stage it never idles waiting for the first gradient;
- `even`: the same pipeline with layers split evenly (3, 3);
- `fast_alone` / `slow_alone`: each worker trains the whole model by itself.

`ideal_throughput` is fast_alone + slow_alone: what the two chips would deliver if no
work were ever lost to imbalance, the pipeline bubble or communication. Every run uses
the same micro-batches (pipeline micro-batches or gradient accumulation), so the only
difference between them is how the work is spread. Throughput is the step's tokens over
the median step time after the warm-up steps.

The pipeline pays per micro-batch what the single chip does not (stage bookkeeping,
activation and gradient hand-over): about 1.5 ms of CPU per stage here, 5% of a
single-sequence micro-batch on the fast stage. Hence 4 sequences per micro-batch, while
64 micro-batches keep the fill and drain of the pipeline to about 1/64 of the step (fewer,
larger micro-batches would trade that overhead for a bigger bubble). Timings on a machine
shared with other work move by several percent from run to run: read them with its load.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from typing import Any

from baige_ray.bench.measure import steady_median, steady_throughput

SPEEDS = (1.0, 0.5)


def speed_proportional_split(
    num_layers: int, speeds: Sequence[float], fixed_costs: Sequence[float] | None = None
) -> tuple[int, ...]:
    """Layers per pipeline stage that minimise the slowest stage's time, stage i on a chip of speed[i].

    A stage's time is (layers + fixed cost) / speed, the fixed cost (in layers) standing for
    work that does not move, such as the LM head on the last stage. Every stage keeps at
    least one layer. Layers are handed out one at a time to the stage whose time grows
    least; for a bottleneck objective of this form greedy is optimal, and with equal fixed
    costs it gives layers in proportion to speed (6 layers at 1.0 / 0.5 -> (4, 2)).
    """
    if not speeds or min(speeds) <= 0:
        raise ValueError(f"speeds={list(speeds)!r} is invalid: expected positive numbers")
    if num_layers < len(speeds):
        raise ValueError(f"{num_layers} layers cannot fill {len(speeds)} pipeline stages")
    costs = list(fixed_costs) if fixed_costs is not None else [0.0] * len(speeds)
    if len(costs) != len(speeds):
        raise ValueError(f"fixed_costs={costs!r} is invalid: expected {len(speeds)} entries")
    layers = [1] * len(speeds)
    for _ in range(num_layers - len(speeds)):
        # Ties go to the earlier stage, so equal speeds give ParallelLayout's even split.
        stage = min(range(len(speeds)), key=lambda i: ((layers[i] + 1 + costs[i]) / speeds[i], i))
        layers[stage] += 1
    return tuple(layers)


def pipeline_step_units(stage_layers: Sequence[int], speeds: Sequence[float], fixed_costs: Sequence[float],
                        num_microbatches: int) -> float:
    """1F1B step time in layer-times of a speed-1 chip: sum_i T_i + (m - 1) max_i T_i (the planner's model)."""
    times = [(n + c) / s for n, c, s in zip(stage_layers, fixed_costs, speeds)]
    return sum(times) + (num_microbatches - 1) * max(times)


def plan_stages(num_layers: int, chip_speeds: Sequence[float], head_cost: float,
                num_microbatches: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Which chip holds which stage, and its layers, for the fastest 1F1B step.

    The last stage also carries the LM head and loss (`head_cost`, in layers), so the
    order matters: with 6 layers at speeds 1.0 / 0.5 and a head of 0.08 layers, the slow
    chip first and (2, 4) layers gives stages of 4.0 and 4.08 layer-times, the fast chip
    first and (4, 2) gives 4.0 and 4.16. Ties keep the given order.
    """
    best: tuple[float, tuple[float, ...], tuple[int, ...]] | None = None
    for order in dict.fromkeys(itertools.permutations(chip_speeds)):
        costs = [0.0] * (len(order) - 1) + [head_cost]
        layers = speed_proportional_split(num_layers, order, costs)
        units = pipeline_step_units(layers, order, costs, num_microbatches)
        if best is None or units < best[0] - 1e-9:
            best = (units, tuple(order), layers)
    return best[1], best[2]


def head_cost_in_layers(model: Any) -> float:
    """The LM head's forward FLOPs over one transformer block's (planner's FLOP model)."""
    from baige_ray.planner.model_spec import ModelSpec

    spec = ModelSpec.from_gpt_config(model, global_batch=1)
    return spec.logits_flops_per_token / spec.layer_flops_per_token


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a balanced 1F1B pipeline: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=64, help="pipeline micro-batches per step")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--run-ahead", type=int, default=3, help="extra forwards in flight on stage 0")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the steady state")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os
    import tempfile
    import time

    from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
    from baige_ray.engines.layout import ParallelLayout
    from baige_ray.models.corpus import CorpusConfig
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.bench.measure import bench_ray
    from baige_ray.runtime.fit import fit

    if args.steps <= args.warmup:
        raise ValueError(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    model = GPTConfig(num_layers=args.num_layers, hidden=args.hidden, num_heads=args.num_heads, seq_len=args.seq_len)
    global_batch = args.microbatches * args.micro_batch_size
    train = TrainConfig(
        num_steps=args.steps, global_batch_size=global_batch, micro_batch_size=args.micro_batch_size,
        warmup_steps=1, log_every=1,
    )
    stage_speeds, planned_layers = plan_stages(args.num_layers, SPEEDS, head_cost_in_layers(model), args.microbatches)
    even_layers = ParallelLayout(pp=len(SPEEDS)).layers_per_stage(args.num_layers)
    pipeline = dict(pp=len(SPEEDS), num_microbatches=args.microbatches, stage_speeds=stage_speeds,
                    pipeline_run_ahead=args.run_ahead)
    cases = [  # (name, layout, speeds); interleaved so slow drift on a shared box hits all alike
        ("fast_alone", ParallelLayout(), [SPEEDS[0]]),
        ("planned", ParallelLayout(**pipeline, stage_layers=planned_layers), list(stage_speeds)),
        ("even", ParallelLayout(**pipeline, stage_layers=even_layers), list(stage_speeds)),
        ("slow_alone", ParallelLayout(), [SPEEDS[1]]),
    ]
    runs: dict[str, dict[str, Any]] = {}
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="baige-bench-hetero-") as tmp, bench_ray(num_cpus=4):
        for name, layout, speeds in cases:
            result = fit(
                model, train=train, layout=layout, emulated_speeds=speeds,
                scaling=ScalingConfig(num_workers=layout.world_size, accelerator="cpu"),
                run=RunConfig(name=f"hetero-{name}", storage_path=tmp, show_progress=False),
                corpus=CorpusConfig(max_bytes=2 * 1024 * 1024),
            )
            times = [m.step_time_s for m in result.metrics]
            tokens = [m.tokens for m in result.metrics]
            runs[name] = {
                "stage_layers": list(layout.layers_per_stage(args.num_layers)),
                "speeds": speeds,
                "throughput": steady_throughput(tokens, times, args.warmup),
                "median_step_s": steady_median(times, args.warmup),
                "step_times_s": [round(t, 4) for t in times],
                "fit_s": round(result.elapsed_s, 2),
            }
    ideal = runs["fast_alone"]["throughput"] + runs["slow_alone"]["throughput"]
    planned = runs["planned"]["throughput"]
    return {
        "planned_throughput": round(planned, 2),
        "ideal_throughput": round(ideal, 2),
        "ratio": round(planned / ideal, 4),
        "even_split_ratio": round(runs["even"]["throughput"] / ideal, 4),
        "even_throughput": round(runs["even"]["throughput"], 2),
        "fast_alone_throughput": round(runs["fast_alone"]["throughput"], 2),
        "slow_alone_throughput": round(runs["slow_alone"]["throughput"], 2),
        "measured_slow_speed": round(runs["slow_alone"]["throughput"] / runs["fast_alone"]["throughput"], 4),
        "planned_stage_layers": list(planned_layers),
        "stage_speeds": list(stage_speeds),
        "even_stage_layers": list(even_layers),
        "speeds": list(SPEEDS),
        "microbatches": args.microbatches,
        "micro_batch_size": args.micro_batch_size,
        "run_ahead": args.run_ahead,
        "bubble_fraction": round(bubble_fraction(len(SPEEDS), args.microbatches), 4),
        "model": {"num_layers": args.num_layers, "hidden": args.hidden, "seq_len": args.seq_len},
        "global_batch_size": global_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "runs": runs,
        "bench_s": round(time.perf_counter() - started, 1),
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
    }


def summarize(result: dict[str, Any]) -> str:
    lines = ["run          stage_layers  speeds      tokens/s   median_step_s"]
    for name, row in result["runs"].items():
        lines.append(f"{name:<12} {str(row['stage_layers']):<13} {str(row['speeds']):<11} "
                     f"{row['throughput']:>9.1f}  {row['median_step_s']:>10.3f}")
    lines.append(f"ideal (fast + slow alone): {result['ideal_throughput']:.1f} tokens/s; "
                 f"planned {result['planned_stage_layers']}: ratio {result['ratio']:.3f}; "
                 f"even {result['even_stage_layers']}: ratio {result['even_split_ratio']:.3f}")
    lines.append(f"1F1B bubble with {result['microbatches']} micro-batches: {result['bubble_fraction']:.1%}; "
                 f"measured speed of the emulated 0.5 chip: {result['measured_slow_speed']:.3f}")
    return "\n".join(lines)
