"""Planner wall time for GPT-175B at 16,384 / 100,000 / 1,024 devices, and planner vs brute force on small grids.

`plan_s` is the wall time of `plan()` (search, mapping, groups, alternatives) on a graph
built beforehand; `graph_s` is the graph build, reported apart. Sizes use the H100
rail-optimized descriptor with its node count set to reach the size. Brute force
enumerates the whole search space under the same cost model on several small clusters
and models; a case matches when the planner's pick has the brute-force optimum's step
time (to 1e-9) and configuration.
"""

from __future__ import annotations

import argparse
from typing import Any

from baige_ray.catalog import cluster_descriptor

SIZES = (16_384, 100_000, 1_024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="device counts to plan")
    parser.add_argument("--skip-brute-force", action="store_true", help="only time the planner")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results = [_time_plan(size) for size in args.sizes]
    cases = [] if args.skip_brute_force else _brute_force_cases()
    return {"results": results, "brute_force_cases": len(cases),
            "brute_force_matches": sum(case["match"] for case in cases), "brute_force": cases}


def summarize(result: dict[str, Any]) -> str:
    lines = ["devices  model      plan_s  graph_s  layout                      step_s   mfu"]
    for row in result["results"]:
        lines.append(f"{row['devices']:>7}  {row['model']:<9} {row['plan_s']:>7.3f} {row['graph_s']:>8.3f}  "
                     f"{row['layout']:<26} {row['step_time_s']:>7.3f} {row['mfu']:>5.1%}")
    lines.append(f"brute force: {result['brute_force_matches']} / {result['brute_force_cases']} picks match")
    lines += [f"  {c['case']}: planner {c['planner']} vs brute force {c['brute_force']}"
              f" ({c['brute_force_s']:.1f} s)" for c in result["brute_force"]]
    return "\n".join(lines)


def _time_plan(devices: int) -> dict[str, Any]:
    import time

    from baige_ray.planner.model_spec import load_model_spec
    from baige_ray.planner.plan import plan

    model = load_model_spec("gpt-175b")
    start = time.perf_counter()
    graph = h100_graph(devices)
    graph_s = time.perf_counter() - start
    start = time.perf_counter()
    chosen = plan(model, graph)
    plan_s = time.perf_counter() - start
    return {"devices": devices, "model": model.name, "plan_s": round(plan_s, 4), "graph_s": round(graph_s, 4),
            "ranks": chosen.num_ranks, "layout": f"tp={chosen.tp} pp={chosen.pp} dp={chosen.dp}",
            "step_time_s": chosen.step_time_s, "mfu": chosen.mfu,
            "layouts_priced": chosen.search_stats["layouts_priced"], "layouts": chosen.search_stats["layouts"]}


def h100_graph(devices: int, nodes_per_leaf: int | None = None):
    """The H100 rail-optimized descriptor (clusters/h100-rail-2048.yaml) with enough nodes for `devices`."""
    import yaml

    from baige_ray.topology.descriptor import descriptor_from_dict
    from baige_ray.topology.graph import ResourceGraph

    raw = yaml.safe_load(cluster_descriptor("h100-rail-2048").read_text())
    raw["nodes"][0]["count"] = -(-devices // 8)
    if nodes_per_leaf is not None:
        raw["network"].update(nodes_per_leaf=nodes_per_leaf, leaves_per_pod=2)
    return ResourceGraph.from_descriptor(descriptor_from_dict(raw))


def _small_grids() -> list[tuple[str, Any, Any]]:
    """(name, model, graph): clusters with NVSwitch, PCIe-free rails, leaves, pods, mixed chips; dense + MoE."""
    from baige_ray.planner.model_spec import ModelSpec
    from baige_ray.topology.descriptor import load_descriptor
    from baige_ray.topology.graph import ResourceGraph

    def load(name: str) -> ResourceGraph:
        return ResourceGraph.from_descriptor(load_descriptor(name))

    dense = ModelSpec(name="gpt-1b", num_layers=8, hidden=2048, ffn_hidden=8192, num_heads=16, seq_len=1024,
                      vocab_size=32000, global_batch=32)
    wide = ModelSpec(name="gpt-13b", num_layers=8, hidden=5120, ffn_hidden=20480, num_heads=40, seq_len=2048,
                     vocab_size=51200, global_batch=16)
    moe = ModelSpec(name="moe-4x", num_layers=4, hidden=1024, ffn_hidden=4096, num_heads=8, num_kv_heads=2,
                    seq_len=1024, vocab_size=32000, global_batch=16, num_experts=4, top_k=2)
    dgx = load("dgx-a100-superpod")
    mixed = load("mixed-h100-a100")
    return [("sim-2x4/gpt-1b", dense, load("sim-2x4")),
            ("sim-2x4/moe-4x", moe, load("sim-2x4")),
            ("dgx-2-nodes/gpt-13b", wide, dgx.without_nodes(dgx.node_ids[2:])),
            ("h100-4-nodes-2-leaves/gpt-1b", dense, h100_graph(32, nodes_per_leaf=1)),
            ("mixed-1+1-nodes/gpt-13b", wide, mixed.without_nodes([n for n in mixed.node_ids if n not in (0, 16)]))]


def _brute_force_cases() -> list[dict[str, Any]]:
    import time

    from baige_ray.planner.bruteforce import brute_force
    from baige_ray.planner.options import PlanOptions
    from baige_ray.planner.search import Hardware, search

    cases = []
    for name, model, graph in _small_grids():
        options = PlanOptions()
        start = time.perf_counter()
        exact = brute_force(model, graph, options)
        brute_s = time.perf_counter() - start
        ranked = search(model, options, Hardware(graph, options)).ranked
        pick = ranked[0] if ranked else None
        match = (pick is None and exact is None) or (
            pick is not None and exact is not None and abs(pick.step_s - exact.step_s) <= 1e-9 * exact.step_s
            and pick.order_key[1:] == exact.order_key[1:])
        cases.append({"case": name, "devices": graph.num_devices, "match": bool(match),
                      "planner": _describe(pick), "brute_force": _describe(exact), "brute_force_s": brute_s})
    return cases


def _describe(candidate) -> str:
    if candidate is None:
        return "infeasible"
    layout = candidate.layout
    return (f"tp={layout.tp} pp={layout.pp} dp={layout.dp} ep={candidate.ep} zero={candidate.zero} "
            f"b={candidate.micro_batch} rc={candidate.recompute} {layout.mapping} {candidate.step_s:.6g}s")
