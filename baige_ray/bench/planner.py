"""The planner's calibrated predictions against step times that ran, on the simulated 8-device cluster.

On `clusters/sim-2x4.yaml` (8 workers sharing this machine's cores), the cluster is calibrated
first (`jobs/calibrate.py`), one model at a time as plans would ask: the first call measures the link
tiers, overlap, optimizer and host sharing with the first model's compute curves, the second adds
the other model's curves; each call timed, then both asked again to show the reuse. Then, for the
reference GPT and a Llama-architecture Hugging Face model (tokenizer trained here), every layout the
engines run on 8 devices: TP inside a node (1, 2, 4), PP dividing the layers, DP the rest; data parallel as
`runtime/auto_plan.layout_from_plan` runs the planner's ZeRO stage (DDP, DeepSpeed ZeRO-1/2/3
without TP/PP, FSDP2 with them). Each layout runs with the micro-batch the planner predicts
fastest for it, and `fit` measures it: the median of the steady steps (the first `--warmup` left
out). Reported per layout: predicted (calibrated) and measured step seconds, relative error;
over all layouts the median and worst relative error, the Spearman rank correlation of
predicted against measured, and `pick_vs_best`: the measured step of the layout the planner
picks (`plan()` with the same options) over the measured fastest. `published` compares the
uncalibrated planner with published training runs (bench/published.py), never fitted to them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from baige_ray.bench.measure import report_stage

GLOBAL_BATCH = 16
GPT_SHAPE = {"num_layers": 4, "hidden": 256, "num_heads": 8, "seq_len": 128, "vocab_size": 256}
LLAMA_SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=["gpt", "llama"], default=["gpt", "llama"])
    parser.add_argument("--steps", type=int, default=10, help="steps per layout, warm-up included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each model's layouts run, every other round in reverse order; a layout's "
                             "measured step is the median over its rounds, so one slow round is left out (the "
                             "machine's speed drifts: one layout measured 0.619 and 0.429 s in two rounds)")
    parser.add_argument("--quick", action="store_true", help="4 layouts per model, 6 steps each")
    parser.add_argument("--layouts", nargs="+", default=None, metavar="TEXT",
                        help="run only the layouts whose name holds one of these, e.g. 'pp=1 dp=8' or zero2 (the "
                             "figures then cover those layouts alone: for a look at some, not the acceptance)")
    parser.add_argument("--work-dir", default=None, help="model, tokenizer, data and calibration (default: a temp dir)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from baige_ray.topology.connect import open_cluster

    steps, warmup = (6, 2) if args.quick else (args.steps, args.warmup)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-planner-"))
    with open_cluster("sim-2x4", log_to_driver=False):
        from baige_ray.runtime.auto_plan import first_devices, live_graph

        graph = first_devices(live_graph(), 8)
        models = [_model(name, work) for name in args.models]
        calibration, timing = _calibrate(graph, [(model, spec) for _, model, _, spec in models], work / "calibration",
                                         args)
        rows, picks = [], []
        for name, model, data, spec in models:
            configs = runnable_configs(spec, graph, calibration, limit=4 if args.quick else None)
            if args.layouts:
                configs = [c for c in configs if any(text in c["layout"] for text in args.layouts)]
            rounds: dict[str, list[float]] = {config["layout"]: [] for config in configs}
            for round_index in range(max(1, args.rounds)):
                ordered = configs if round_index % 2 == 0 else configs[::-1]
                for index, config in enumerate(ordered):
                    report_stage(args, f"{name} round {round_index + 1}: {config['layout']}", index, len(configs))
                    rounds[config["layout"]].append(_measure(model, data, config, steps, warmup, work))
                    with open(work / "layouts.jsonl", "a") as log:  # what ran so far, should the bench stop
                        log.write(json.dumps({"model": name, **config, "measured_s": rounds[config["layout"]][-1]})
                                  + "\n")
            for config in configs:
                measured = float(np.median(rounds[config["layout"]]))
                rows.append({"model": name, **config, "measured_s": measured, "rounds_s": rounds[config["layout"]],
                             "rel_error": config["predicted_s"] / measured - 1.0})
            picks.append(_pick_row(name, spec, graph, calibration, [r for r in rows if r["model"] == name]))
    from baige_ray.bench.published import compare_published

    return {**accuracy(rows), "pick_vs_best": max(p["pick_vs_best"] for p in picks), "picks": picks,
            "calibration": timing, "layouts": rows, "steps": steps, "warmup": warmup,
            "published": compare_published()}


def accuracy(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median and worst |relative error|, and Spearman's rank correlation per model (the worst)."""
    errors = np.abs([row["rel_error"] for row in rows])
    by_model: dict[str, list[dict]] = {}
    for row in rows:
        by_model.setdefault(row["model"], []).append(row)
    correlations = [spearman([r["predicted_s"] for r in group], [r["measured_s"] for r in group])
                    for group in by_model.values() if len(group) > 1]
    return {"median_rel_error": float(np.median(errors)), "max_rel_error": float(errors.max()),
            "spearman": float(min(correlations)) if correlations else float("nan"),
            "spearman_by_model": {m: spearman([r["predicted_s"] for r in g], [r["measured_s"] for r in g])
                                  for m, g in by_model.items() if len(g) > 1}}


def spearman(a, b) -> float:
    """Pearson correlation of the ranks (ties get their mean rank)."""
    ranks = [_ranks(np.asarray(x, dtype=np.float64)) for x in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def _ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values), dtype=np.float64)
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def summarize(result: dict[str, Any]) -> str:
    timing = result["calibration"]
    later = ", ".join(f"{name} added {seconds:.1f} s" for name, seconds in list(timing["per_model_s"].items())[1:])
    lines = [f"calibration of the cluster with the first model {timing['first_s']:.1f} s"
             + (f" ({later})" if later else "") + f", reused in {timing['reuse_s']:.3f} s",
             "model   layout                              b  predicted_s  measured_s   error"]
    for row in result["layouts"]:
        lines.append(f"{row['model']:<7} {row['layout']:<34} {row['micro_batch']:>2} {row['predicted_s']:>11.3f} "
                     f"{row['measured_s']:>11.3f} {row['rel_error']:>+7.1%}")
    lines.append(f"median |error| {result['median_rel_error']:.1%}, worst {result['max_rel_error']:.1%}, "
                 f"Spearman {result['spearman']:.2f}, pick vs best {result['pick_vs_best']:.3f}")
    lines += [f"  {p['model']}: planner picks {p['pick']}, measured fastest {p['fastest']}" for p in result["picks"]]
    from baige_ray.bench.published import summarize as published_table

    lines += ["", "uncalibrated predictions against published runs (examples/models/published-runs.yaml):",
              published_table(result["published"])]
    return "\n".join(lines)


# ---- models, calibration, layouts -----------------------------------------------------------------


def _model(name: str, work: Path):
    """(name, model, data, ModelSpec in the engines' fp32 precision)."""
    if name == "gpt":
        from baige_ray.models.corpus import CorpusConfig
        from baige_ray.models.gpt import GPTConfig
        from baige_ray.planner.model_spec import ModelSpec

        config = GPTConfig(**GPT_SHAPE)
        return name, config, CorpusConfig(), ModelSpec.from_gpt_config(config, global_batch=GLOBAL_BATCH,
                                                                         dtype_bytes=4)
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf.tiny import make_llama_tiny

    model, data = make_llama_tiny(work / "llama", shape=LLAMA_SHAPE, name="llama-256")
    job = TrainJob(model=model, train=_train(1, None), data=data)
    return name, model, data, job.plugin.model_spec(global_batch=GLOBAL_BATCH, dtype_bytes=4)


def _calibrate(graph, models, directory: Path, args) -> tuple[Any, dict[str, Any]]:
    """Calibration of `graph` for the (model config, spec) pairs, their own layers timed, one model at a
    time as plans meet it: the first model's call measures the cluster (links, overlap, optimizer, host
    sharing) with its compute curves; each later model's adds only its own curves. Then a plan of every
    model asks again, which reuses what is kept."""
    from baige_ray.jobs.calibrate import CalibrationRequest, calibrate

    per_model: dict[str, float] = {}
    for index, (model, spec) in enumerate(models):
        report_stage(args, f"calibrating the cluster for {spec.name}", index, len(models))
        start = time.perf_counter()
        calibration = calibrate(graph, CalibrationRequest(models=(spec,), model_configs={spec.name: model}),
                                directory=directory, refresh=index == 0)
        per_model[spec.name] = time.perf_counter() - start
    everything = CalibrationRequest(models=tuple(spec for _, spec in models),
                                    model_configs={spec.name: model for model, spec in models})
    start = time.perf_counter()
    calibration = calibrate(graph, everything, directory=directory)
    return calibration, {"first_s": next(iter(per_model.values())), "per_model_s": per_model,
                         "total_s": sum(per_model.values()), "reuse_s": time.perf_counter() - start,
                         "phases_s": dict(calibration.seconds), "measured": calibration.measured_terms(),
                         "overlap": calibration.overlap}


def plan_options(calibration):
    from baige_ray.planner.options import PlanOptions
    from baige_ray.runtime.auto_plan import ENGINE_OVERLAPPED_ZERO_STAGES

    return PlanOptions(calibration=calibration, recompute=("none",), expert_parallel_zero_stages=(0, 1, 2),
                       mappings=("tp-dp-pp/node",), overlapped_zero_stages=ENGINE_OVERLAPPED_ZERO_STAGES)


def runnable_configs(spec, graph, calibration, limit: int | None = None) -> list[dict[str, Any]]:
    """Per runnable (tp, pp, dp, engine) on the graph, the planner's fastest micro-batch and its prediction."""
    from baige_ray.planner.evaluate import evaluate
    from baige_ray.planner.search import Hardware, pipeline_degrees, tensor_degrees

    options = plan_options(calibration)
    hardware = Hardware(graph, options)
    configs = []
    for tp in tensor_degrees(spec, hardware):
        for pp in pipeline_degrees(spec, hardware, graph.num_devices // tp, options.max_pp):
            if graph.num_devices % (tp * pp):
                continue
            layout, context = layout_and_context(spec, hardware, tp=tp, pp=pp, dp=graph.num_devices // (tp * pp))
            if context is None:
                continue
            for zero in _zero_stages(tp, pp, layout.dp):
                batches = [b for b in range(1, GLOBAL_BATCH // layout.dp + 1) if (GLOBAL_BATCH // layout.dp) % b == 0]
                evaluation = evaluate(spec, options.constants, context, micro_batch_rows(zero, batches))
                best = int(np.argmin(np.where(evaluation.feasible, evaluation.step_s, np.inf)))
                configs.append(_config(layout, zero, batches[best], float(evaluation.step_s[best])))
    configs.sort(key=lambda c: c["predicted_s"])
    return configs if limit is None else configs[:: max(1, len(configs) // limit)][:limit]


def layout_and_context(spec, hardware, *, tp: int, pp: int, dp: int):
    """(Layout, LayoutContext or None where it does not fit) of the first mapping of `hardware`'s options."""
    from baige_ray.planner.evaluate import Layout
    from baige_ray.planner.mapping import layout_links
    from baige_ray.planner.search import expert_sizes, layout_context

    layout = Layout(tp=tp, pp=pp, dp=dp, mapping=hardware.options.mappings[0])
    positions = hardware.positions(layout)
    links = layout_links(hardware.tables, positions, tp=tp, dp=dp, pp=pp,
                         eps=expert_sizes(spec, dp) if spec.is_moe else ())
    return layout, layout_context(spec, hardware, layout, links, positions=positions)


def micro_batch_rows(zero: int, batches: list[int]):
    """Planner rows of one ZeRO stage, no expert parallelism or recomputation, one per micro-batch size."""
    from baige_ray.planner.evaluate import Rows

    return Rows(ep=np.ones(len(batches), dtype=int), zero=np.full(len(batches), zero),
                micro_batch=np.array(batches), recompute=np.zeros(len(batches), dtype=int))


def _zero_stages(tp: int, pp: int, dp: int) -> tuple[int, ...]:
    if dp == 1:
        return (0,)
    if tp == 1 and pp == 1:
        return (0, 1, 2, 3)
    return (0, 3) if pp == 1 else (0,)  # FSDP2 with TP; pipelines run DDP (layout_from_plan)


def _config(layout, zero: int, micro_batch: int, predicted: float) -> dict[str, Any]:
    if layout.tp == 1 and layout.pp == 1 and zero > 0:
        engine = f"zero{zero}"
    else:
        engine = "fsdp2" if zero == 3 else "ddp"
    return {"layout": f"tp={layout.tp} pp={layout.pp} dp={layout.dp} {engine}", "tp": layout.tp, "pp": layout.pp,
            "dp": layout.dp, "zero": zero, "engine": engine, "micro_batch": micro_batch, "predicted_s": predicted}


def _train(steps: int, micro_batch: int | None):
    from baige_ray.api.configs import TrainConfig

    return TrainConfig(num_steps=steps, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch, seed=0,
                       warmup_steps=0)


def _measure(model, data, config: dict[str, Any], steps: int, warmup: int, work: Path) -> float:
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.jobs.fit import fit
    from baige_ray.parallel.layout import ParallelLayout

    per_replica = GLOBAL_BATCH // config["dp"]
    pipelined = config["pp"] > 1
    layout = ParallelLayout(dp=config["dp"], tp=config["tp"], pp=config["pp"], data_parallel=config["engine"],
                            num_microbatches=per_replica // config["micro_batch"] if pipelined else None)
    micro = None if pipelined or config["micro_batch"] == per_replica else config["micro_batch"]
    result = fit(model, train=_train(steps, micro), scaling=ScalingConfig(num_workers=layout.world_size),
                 run=RunConfig(name="bench-planner", storage_path=str(work / "runs"), show_progress=False),
                 data=data, layout=layout)
    return float(np.median([m.step_time_s for m in result.metrics][warmup:]))


def _pick_row(name: str, spec, graph, calibration, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from baige_ray.planner.plan import plan
    from baige_ray.runtime.auto_plan import layout_from_plan

    chosen = plan(spec, graph, plan_options(calibration))
    engine = layout_from_plan(chosen).data_parallel  # ZeRO-1/2 beside TP or PP runs as DDP
    match = [r for r in rows if (r["tp"], r["pp"], r["dp"], r["engine"]) == (chosen.tp, chosen.pp, chosen.dp, engine)]
    fastest = min(rows, key=lambda r: r["measured_s"])
    pick = match[0] if match else None
    return {"model": name, "pick": pick["layout"] if pick else f"tp={chosen.tp} pp={chosen.pp} dp={chosen.dp} "
            f"zero={chosen.zero_stage} (not measured)", "fastest": fastest["layout"],
            "pick_vs_best": pick["measured_s"] / fastest["measured_s"] if pick else float("nan")}
