"""Mixed chip speeds: uneven pipeline or uneven-share data parallel against the ideal sum of each chip alone.

Two workers emulate chips at relative speed 1.0 and 0.5 (`fit(emulated_speeds=...)`:
the slower one sleeps after each forward and each backward for as long again as that
work took, see `SlowChipEmulator`). The same GPT, global batch and micro-batches are
trained in every case, one case after another in one Ray session:

- `pp_uneven`: PP=2 laid out by `plan_stages`: which chip holds which stage and how many
  layers, minimising the 1F1B step time with the LM head counted on the last stage. For
  6 layers at speeds 1.0 / 0.5 that is the slow chip first with 2 layers, the fast chip
  last with 4 layers and the head (4.0 and 4.08 layer-times per micro-batch). Stage 0 runs
  `--run-ahead` forwards beyond 1F1B's, so as the slower stage it never idles waiting for
  the first gradient. Even so its step is sum(T) + (m - 1) max(T): the bubble and the
  4.08 / 4.0 imbalance alone cap it at about 0.978 of the ideal, before any per-micro-batch
  hand-over cost;
- `dp_uneven`: each chip trains a whole replica on micro-batches in proportion to its
  speed (`ParallelLayout.dp_microbatches`, 43 and 21 of 64), losses weighted so the step is
  the single-process step; one gradient all-reduce a step, no bubble (cap 42.67 / 43);
- `pp_even` / `dp_even`: the same layouts with layers, or micro-batches, split evenly;
- `fast_alone` / `slow_alone`: each chip trains the whole model by itself.

`plan_hetero` (pure arithmetic) predicts both uneven layouts' step times and picks the
faster as `planned`; `even_split_ratio` is the even split of the same kind. All four
layouts' ratios are reported.

The ideal is what the two chips deliver if no work were ever lost to imbalance, bubble or
communication: the sum of each chip's throughput training alone. Real chips of two groups
share nothing; emulated ones share this machine's cores, caches and memory bandwidth,
and in every two-chip case both compute at the same time. A chip measured alone on an
otherwise idle machine is therefore faster than the same chip can be in any two-chip
layout here, and the sum of the sequential alone-runs overstates the ideal by the
machine's sharing cost, not by anything a layout loses. So `ideal_throughput` sums the two
alone-runs trained at the same time (`*_alone_concurrent`, two independent `fit`s from two
driver threads; the fast one runs proportionally more steps so both compute throughout),
which puts each chip under the sharing the two-chip layouts have. The sequential sum is
kept beside it (`ideal_sequential_throughput`, `ratio_vs_sequential`).

Throughput is the step's tokens over the median step time after the warm-up steps. The
pipeline pays per micro-batch what a whole replica does not (stage bookkeeping, activation
and gradient hand-over, about 1.5 ms of CPU per stage here), hence 4 sequences per
micro-batch and 64 micro-batches. Timings on a machine shared with other work move by
several percent from run to run: read them with its load.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
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


def data_parallel_step_units(replica_microbatches: Sequence[int], speeds: Sequence[float], model_units: float,
                             allreduce_units: float = 0.0) -> float:
    """Step time of data parallel over mixed chips, in layer-times of a speed-1 chip.

    Replica i trains replica_microbatches[i] micro-batches of the whole model
    (`model_units` layer-times each) on a chip of speed[i]; the step waits for the
    slowest replica, then for one gradient all-reduce.
    """
    return max(n * model_units / s for n, s in zip(replica_microbatches, speeds)) + allreduce_units


@dataclass(frozen=True)
class HeteroPlan:
    """The faster of uneven PP and uneven-share DP for a set of chip speeds, with both predictions."""

    kind: str  # "pipeline" or "data_parallel"
    pipeline_speeds: tuple[float, ...]  # chip speed per pipeline stage, in stage order
    stage_layers: tuple[int, ...]
    dp_microbatches: tuple[int, ...]  # micro-batches per replica, replicas in the given speeds' order
    pipeline_units: float
    data_parallel_units: float


def plan_hetero(num_layers: int, speeds: Sequence[float], head_cost: float, num_microbatches: int, *,
                handover_units: float = 0.0, allreduce_units: float = 0.0) -> HeteroPlan:
    """Predict both ways to use mixed chips and pick the faster (ties go to the pipeline).

    Uneven PP: `plan_stages`, plus `handover_units` per micro-batch and stage boundary
    (activation and gradient exchange). Uneven-share DP: each chip trains the whole model
    (layers plus the head) on micro-batches in proportion to its speed, the split minimising
    the slowest replica (`speed_proportional_split` over micro-batches), plus one
    all-reduce of the gradients a step.
    """
    stage_speeds, stage_layers = plan_stages(num_layers, speeds, head_cost, num_microbatches)
    costs = [0.0] * (len(speeds) - 1) + [head_cost]
    pipeline = pipeline_step_units(stage_layers, stage_speeds, costs, num_microbatches)
    pipeline += num_microbatches * (len(speeds) - 1) * handover_units
    shares = speed_proportional_split(num_microbatches, speeds)
    data_parallel = data_parallel_step_units(shares, speeds, num_layers + head_cost, allreduce_units)
    kind = "data_parallel" if data_parallel < pipeline - 1e-9 else "pipeline"
    return HeteroPlan(kind=kind, pipeline_speeds=stage_speeds, stage_layers=stage_layers, dp_microbatches=shares,
                      pipeline_units=pipeline, data_parallel_units=data_parallel)


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


def _fit_case(model: Any, train: Any, name: str, layout: Any, speeds: list[float], storage: str,
              warmup: int) -> dict[str, Any]:
    """Train one case and reduce it to its steady-state row."""
    import os
    import sys

    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.jobs.fit import fit
    from baige_ray.models.corpus import CorpusConfig

    result = fit(
        model, train=train, layout=layout, emulated_speeds=speeds,
        scaling=ScalingConfig(num_workers=layout.world_size, accelerator="cpu"),
        run=RunConfig(name=f"hetero-{name}", storage_path=storage, show_progress=False),
        data=CorpusConfig(max_bytes=2 * 1024 * 1024),
    )
    times = [m.step_time_s for m in result.metrics]
    tokens = [m.tokens for m in result.metrics]
    # Progress on stderr: on a loaded machine a case takes minutes, and stdout's last line is the result.
    print(f"hetero {name}: median step {steady_median(times, warmup):.3f} s, {result.elapsed_s:.0f} s in all, "
          f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    return {
        "stage_layers": list(layout.layers_per_stage(model.num_layers)),
        "speeds": speeds,
        "throughput": steady_throughput(tokens, times, warmup),
        "median_step_s": steady_median(times, warmup),
        "step_times_s": [round(t, 4) for t in times],
        "losses": [round(m.loss, 5) for m in result.metrics],
        "fit_s": round(result.elapsed_s, 2),
    }


def _fit_alone_concurrently(model: Any, train: Any, storage: str, warmup: int) -> dict[str, dict[str, Any]]:
    """Each chip trains the whole model by itself, both at once: each group's throughput under shared cores.

    The faster chip runs proportionally more steps so that it keeps computing for as
    long as the slower one does: every steady step of either run then overlaps the other.
    """
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from baige_ray.parallel.layout import ParallelLayout

    extra = round(train.num_steps * (max(SPEEDS) / min(SPEEDS) - 1))
    cases = {  # name: (steps, speed)
        "fast_alone_concurrent": (train.num_steps + extra, max(SPEEDS)),
        "slow_alone_concurrent": (train.num_steps, min(SPEEDS)),
    }
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        futures = {
            name: pool.submit(_fit_case, model, dataclasses.replace(train, num_steps=steps), name,
                              ParallelLayout(), [speed], storage, warmup)
            for name, (steps, speed) in cases.items()
        }
        return {name: future.result() for name, future in futures.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os
    import tempfile
    import time

    from baige_ray.api.configs import TrainConfig
    from baige_ray.bench.measure import bench_ray
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.parallel.layout import ParallelLayout

    if args.steps <= args.warmup:
        raise ValueError(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    model = GPTConfig(num_layers=args.num_layers, hidden=args.hidden, num_heads=args.num_heads, seq_len=args.seq_len)
    global_batch = args.microbatches * args.micro_batch_size
    train = TrainConfig(
        num_steps=args.steps, global_batch_size=global_batch, micro_batch_size=args.micro_batch_size,
        warmup_steps=1, log_every=1,
    )
    plan = plan_hetero(args.num_layers, SPEEDS, head_cost_in_layers(model), args.microbatches)
    even_layers = ParallelLayout(pp=len(SPEEDS)).layers_per_stage(args.num_layers)
    pipeline = dict(pp=len(SPEEDS), num_microbatches=args.microbatches, stage_speeds=plan.pipeline_speeds,
                    pipeline_run_ahead=args.run_ahead)
    cases = [  # (name, layout, per-rank speeds); interleaved so slow drift on a shared box hits all alike
        ("fast_alone", ParallelLayout(), [SPEEDS[0]]),
        ("pp_uneven", ParallelLayout(**pipeline, stage_layers=plan.stage_layers), list(plan.pipeline_speeds)),
        ("dp_uneven", ParallelLayout(dp=len(SPEEDS), dp_microbatches=plan.dp_microbatches), list(SPEEDS)),
        ("pp_even", ParallelLayout(**pipeline, stage_layers=even_layers), list(plan.pipeline_speeds)),
        ("dp_even", ParallelLayout(dp=len(SPEEDS)), list(SPEEDS)),
        ("slow_alone", ParallelLayout(), [SPEEDS[1]]),
    ]
    runs: dict[str, dict[str, Any]] = {}
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="baige-bench-hetero-") as tmp, bench_ray(num_cpus=4):
        for name, layout, speeds in cases:
            runs[name] = _fit_case(model, train, name, layout, speeds, tmp, args.warmup)
        runs.update(_fit_alone_concurrently(model, train, tmp, args.warmup))
    planned, even = ("dp_uneven", "dp_even") if plan.kind == "data_parallel" else ("pp_uneven", "pp_even")
    return {
        **ratios(runs, planned, even),
        "planned_layout": planned,
        "even_layout": even,
        "predicted_units": {"pp_uneven": round(plan.pipeline_units, 2), "dp_uneven": round(plan.data_parallel_units, 2),
                            "ideal": round(args.microbatches * (args.num_layers + head_cost_in_layers(model))
                                           / sum(SPEEDS), 2)},
        "pp_stage_layers": list(plan.stage_layers),
        "pp_stage_speeds": list(plan.pipeline_speeds),
        "pp_even_stage_layers": list(even_layers),
        "dp_microbatches": list(plan.dp_microbatches),
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


LAYOUTS = ("pp_uneven", "dp_uneven", "pp_even", "dp_even")


def ratios(runs: dict[str, dict[str, Any]], planned: str, even: str) -> dict[str, Any]:
    """Throughputs and ratios to the concurrent ideal, with the sequential ideal's beside them."""
    throughput = {name: row["throughput"] for name, row in runs.items()}
    ideal = throughput["fast_alone_concurrent"] + throughput["slow_alone_concurrent"]
    sequential = throughput["fast_alone"] + throughput["slow_alone"]
    return {
        "planned_throughput": round(throughput[planned], 2),
        "ideal_throughput": round(ideal, 2),
        "ratio": round(throughput[planned] / ideal, 4),
        "even_split_ratio": round(throughput[even] / ideal, 4),
        "ideal_sequential_throughput": round(sequential, 2),
        "ratio_vs_sequential": round(throughput[planned] / sequential, 4),
        "even_split_ratio_vs_sequential": round(throughput[even] / sequential, 4),
        "layouts": {
            name: {"throughput": round(throughput[name], 2), "ratio": round(throughput[name] / ideal, 4),
                   "ratio_vs_sequential": round(throughput[name] / sequential, 4)}
            for name in LAYOUTS
        },
        "fast_alone_throughput": round(throughput["fast_alone"], 2),
        "slow_alone_throughput": round(throughput["slow_alone"], 2),
        "measured_slow_speed": round(throughput["slow_alone"] / throughput["fast_alone"], 4),
        "measured_slow_speed_concurrent": round(
            throughput["slow_alone_concurrent"] / throughput["fast_alone_concurrent"], 4),
    }


def summarize(result: dict[str, Any]) -> str:
    lines = ["run                    stage_layers  speeds      tokens/s   median_step_s"]
    for name, row in result["runs"].items():
        lines.append(f"{name:<22} {str(row['stage_layers']):<13} {str(row['speeds']):<11} "
                     f"{row['throughput']:>9.1f}  {row['median_step_s']:>10.3f}")
    lines.append(f"ideal: {result['ideal_throughput']:.1f} tokens/s (chips alone, concurrently), "
                 f"{result['ideal_sequential_throughput']:.1f} (one after the other)")
    for name, row in result["layouts"].items():
        mark = " <- planned" if name == result["planned_layout"] else ""
        lines.append(f"{name:<10} ratio {row['ratio']:.3f} (vs sequential {row['ratio_vs_sequential']:.3f}){mark}")
    lines.append(f"1F1B bubble with {result['microbatches']} micro-batches: {result['bubble_fraction']:.1%}; "
                 f"DP micro-batches per chip {result['dp_microbatches']}; measured speed of the emulated 0.5 chip: "
                 f"{result['measured_slow_speed']:.3f} alone, {result['measured_slow_speed_concurrent']:.3f} concurrently")
    return "\n".join(lines)
