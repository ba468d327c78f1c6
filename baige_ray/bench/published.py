"""The planner's step-time predictions against published DGX A100 training runs.

Rows (examples/models/published-runs.yaml, sources in examples/models/SOURCES.md):
  * Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM" (arXiv 2104.04473), Table 1: GPT 1.7B ... 1T on 32 ... 3072 A100s, TFLOP/s per GPU
    counted with the paper's eq. 3, 96*B*s*l*h^2*(1 + s/6h + V/16lh), which includes the recompute forward.
  * Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv 2205.05198), Tables 3 and 5: seconds per iteration with full and with selective recomputation.

Each run's reported layout is priced as it ran (`price_candidate`, the fastest of the planner's rank
mappings; where the paper gives no micro-batch size, the planner's fastest memory-feasible one) on the
`clusters/dgx-a100-superpod.yaml` descriptor sized to the run, and `plan()` gives the planner's own pick.
Predicted and reported figures are compared as seconds per step; TFLOP/s per GPU on both sides use the
paper's own FLOP formula. Default `PlanOptions`: none of the cost model's constants is fitted to these runs.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from baige_ray.catalog import PUBLISHED_PACKAGE, cluster_descriptor, shipped_file
from baige_ray.planner.evaluate import Evaluation, Layout
from baige_ray.planner.explain import breakdown
from baige_ray.planner.mapping import MAPPINGS
from baige_ray.planner.memory import RECOMPUTE
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.plan import plan, price_candidate
from baige_ray.planner.search import Candidate, Hardware
from baige_ray.topology.descriptor import descriptor_from_dict
from baige_ray.topology.graph import ResourceGraph

RUNS_PATH = shipped_file(PUBLISHED_PACKAGE, "published-runs.yaml")
DESCRIPTOR_PATH = cluster_descriptor("dgx-a100-superpod")
DEVICES_PER_NODE = 8
FLOPS_FORMULAS = ("megatron_eq3", "korthikanti_eq7")


def load_runs(path: str | Path = RUNS_PATH) -> list[dict[str, Any]]:
    """The rows of a published-runs YAML, checked for the fields the comparison reads."""
    runs = yaml.safe_load(Path(path).read_text())
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{path}: expected a non-empty list of runs")
    for run in runs:
        missing = {"name", "model", "layout", "gpus", "reported", "flops_formula"} - set(run)
        if missing:
            raise ValueError(f"{path}: run {run.get('name')!r} lacks {sorted(missing)}")
        if run["flops_formula"] not in FLOPS_FORMULAS:
            raise ValueError(f"{path}: run {run['name']!r} flops_formula={run['flops_formula']!r} is invalid: "
                             f"expected one of {', '.join(FLOPS_FORMULAS)}")
    return runs


def paper_flops(run: dict[str, Any]) -> float:
    """FLOPs of one iteration as the run's paper counts them (Narayanan eq. 3 or Korthikanti eq. 7)."""
    m = run["model"]
    batch, s, layers, h, vocab = m["global_batch"], m["seq_len"], m["num_layers"], m["hidden"], m["vocab_size"]
    if run["flops_formula"] == "megatron_eq3":
        return 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))
    return 72.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))


def reported_step_s(run: dict[str, Any]) -> float:
    """Seconds per iteration: as reported, or the paper's FLOPs over its reported TFLOP/s per GPU."""
    reported = run["reported"]
    if reported.get("step_s") is not None:
        return float(reported["step_s"])
    return paper_flops(run) / (float(reported["tflops_per_gpu"]) * 1e12 * run["gpus"])


def model_spec(run: dict[str, Any]) -> ModelSpec:
    return ModelSpec(name=run["name"], **run["model"])


def dgx_a100_graph(gpus: int) -> ResourceGraph:
    """The DGX A100 SuperPOD descriptor with just enough nodes, trailing devices dropped to `gpus`."""
    raw = yaml.safe_load(DESCRIPTOR_PATH.read_text())
    raw["nodes"][0]["count"] = -(-gpus // DEVICES_PER_NODE)
    graph = ResourceGraph.from_descriptor(descriptor_from_dict(raw))
    extra = graph.num_devices - gpus
    return graph.without_devices(graph.devices.device_id[-extra:]) if extra else graph


def micro_batches(model: ModelSpec, options: PlanOptions, dp: int, stated: int | None) -> list[int]:
    """The stated micro-batch size, else every size the planner allows for this data-parallel degree."""
    if stated is not None:
        return [int(stated)]
    per_replica = model.global_batch // dp
    return [b for b in range(1, min(per_replica, options.max_micro_batch) + 1) if per_replica % b == 0]


def price_reported(model: ModelSpec, options: PlanOptions, hardware: Hardware,
                   layout: dict[str, Any]) -> tuple[Candidate, Evaluation]:
    """The reported layout at its fastest mapping (and micro-batch, when unstated): memory-feasible rows
    first, the fastest infeasible one only when none fits."""
    best: tuple[tuple[bool, float], Candidate, Evaluation] | None = None
    for mapping in MAPPINGS:
        shape = Layout(tp=layout["tp"], pp=layout["pp"], dp=layout["dp"], mapping=mapping)
        for b in micro_batches(model, options, layout["dp"], layout.get("micro_batch")):
            candidate = Candidate(layout=shape, ep=1, zero=int(layout.get("zero", 0)), micro_batch=b,
                                  recompute=RECOMPUTE.index(layout["recompute"]), step_s=0.0, memory_ratio=0.0)
            _, evaluation = price_candidate(model, options, hardware, candidate)
            key = (bool(evaluation.memory_ratio[0] > 1.0), float(evaluation.step_s[0]))
            if best is None or key < best[0]:
                best = (key, candidate, evaluation)
    assert best is not None
    return best[1], best[2]


def planner_pick(model: ModelSpec, graph: ResourceGraph, options: PlanOptions, layout: dict[str, Any]) -> dict:
    chosen = plan(model, graph, options)
    return {"layout": f"tp={chosen.tp} pp={chosen.pp} dp={chosen.dp}", "zero": chosen.zero_stage,
            "micro_batch": chosen.micro_batch_size, "recompute": chosen.recompute, "mapping": chosen.mapping,
            "step_s": chosen.step_time_s, "matches_reported_tp_pp": chosen.tp == layout["tp"]
            and chosen.pp == layout["pp"]}


def compare_run(run: dict[str, Any], graph: ResourceGraph, hardware: Hardware, options: PlanOptions) -> dict:
    """One row: the reported layout priced, the reported step, their error and the planner's own pick."""
    model, layout = model_spec(run), run["layout"]
    candidate, evaluation = price_reported(model, options, hardware, layout)
    predicted, reported = float(evaluation.step_s[0]), reported_step_s(run)
    flops, gpus = paper_flops(run), run["gpus"]
    stated = layout.get("micro_batch") is not None
    return {
        "name": run["name"], "arxiv": run.get("citation", {}).get("arxiv"), "gpus": gpus,
        "layout": f"tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}", "recompute": layout["recompute"],
        "zero": int(layout.get("zero", 0)), "micro_batch": candidate.micro_batch, "micro_batch_stated": stated,
        "mapping": candidate.layout.mapping, "flops_formula": run["flops_formula"],
        "predicted_step_s": predicted, "reported_step_s": reported, "rel_error": (predicted - reported) / reported,
        "predicted_tflops_per_gpu": flops / (predicted * gpus) / 1e12,
        "reported_tflops_per_gpu": flops / (reported * gpus) / 1e12,
        "memory_ratio": float(evaluation.memory_ratio[0]), "breakdown": breakdown(evaluation),
        "pick": planner_pick(model, graph, options, layout),
        "note": "" if stated else "micro-batch not stated: the planner's fastest for this layout",
    }


def compare_published(path: str | Path = RUNS_PATH) -> dict[str, Any]:
    """Every run of `path` compared; `median_abs_rel_error` and `max_abs_rel_error` over all rows."""
    options = PlanOptions()
    hardware_by_size: dict[int, Hardware] = {}
    rows = []
    for run in load_runs(path):
        gpus = run["gpus"]
        if gpus not in hardware_by_size:
            hardware_by_size[gpus] = Hardware(dgx_a100_graph(gpus), options)
        hardware = hardware_by_size[gpus]
        rows.append(compare_run(run, hardware.graph, hardware, options))
    errors = np.abs([row["rel_error"] for row in rows])
    return {"cluster": DESCRIPTOR_PATH.name, "options": "PlanOptions() defaults, uncalibrated", "runs": rows,
            "median_abs_rel_error": float(statistics.median(errors)), "max_abs_rel_error": float(errors.max())}


def summarize(result: dict[str, Any]) -> str:
    header = (f"{'run':<27}{'gpus':>5}  {'layout':<18}{'rc':<10}{'b':>3} {'pred s':>8} {'paper s':>8} "
              f"{'error':>7} {'pred TF':>8} {'paper TF':>8}  planner pick (default options)")
    lines = [header]
    for row in result["runs"]:
        pick = row["pick"]
        same = "same tp/pp" if pick["matches_reported_tp_pp"] else "differs"
        b = f"{row['micro_batch']}{'' if row['micro_batch_stated'] else '*'}"
        lines.append(f"{row['name']:<27}{row['gpus']:>5}  {row['layout']:<18}{row['recompute']:<10}{b:>3} "
                     f"{row['predicted_step_s']:>8.3f} {row['reported_step_s']:>8.3f} {row['rel_error']:>+7.1%} "
                     f"{row['predicted_tflops_per_gpu']:>8.1f} {row['reported_tflops_per_gpu']:>8.1f}  "
                     f"{pick['layout']} {pick['recompute']} b={pick['micro_batch']} "
                     f"{pick['step_s']:.3f}s ({same})")
    lines.append("* micro-batch not stated by the paper: the planner's fastest memory-feasible size")
    lines.append(f"|relative error| median {result['median_abs_rel_error']:.1%}, "
                 f"max {result['max_abs_rel_error']:.1%} ({len(result['runs'])} runs, {result['options']})")
    return "\n".join(lines)
