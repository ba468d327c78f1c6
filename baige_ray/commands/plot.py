"""`baige-ray plot topology|placement|timeline ... --out FILE.png`: pictures of the cluster, a plan, a run.

  baige-ray plot topology --cluster sim-2x4 --out topo.png
  baige-ray plot placement gpt-175b --cluster h100-rail-2048 --out place.png
  baige-ray plot timeline runs/demo/events.jsonl --out timeline.png
"""

from __future__ import annotations

import argparse
import sys

from tqdm.auto import tqdm


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plot", help="draw PNGs: topology, rank placement, device timeline")
    kinds = parser.add_subparsers(dest="plot", required=True)
    topology = kinds.add_parser("topology", help="nodes by leaf and pod, devices, islands, rails, link tiers")
    topology.add_argument("--cluster", required=True, help="a hardware descriptor's name (sim-2x4, ...) or YAML path")
    placement = kinds.add_parser("placement", help="the planner's ranks on devices, coloured by parallel group")
    placement.add_argument("model", help="a shipped model's name (gpt-175b, ...) or a model YAML / config.json")
    placement.add_argument("--cluster", required=True, help="a hardware descriptor's name or YAML path")
    placement.add_argument("--max-nodes", type=int, default=16, help="nodes drawn at most (a sample when more)")
    timeline = kinds.add_parser("timeline", help="devices held by training and inference over a run, failures marked")
    timeline.add_argument("events", help="a run's event log (events.jsonl)")
    for sub in (topology, placement, timeline):
        sub.add_argument("--out", required=True, help="PNG file to write")
        sub.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    steps = {"topology": _topology_steps, "placement": _placement_steps, "timeline": _timeline_steps}[args.plot](args)
    result = None
    # Planning a large cluster and drawing take seconds: show which part is running.
    with tqdm(total=len(steps), desc=f"plot {args.plot}", unit="step", file=sys.stderr, disable=None) as bar:
        for label, step in steps:
            bar.set_postfix_str(label, refresh=True)
            result = step(result)
            bar.update(1)
    print(result)
    return 0


def _topology_steps(args: argparse.Namespace) -> list:
    from baige_ray.ops.plots import plot_topology

    return [("graph", lambda _: _graph(args.cluster)), ("draw", lambda graph: plot_topology(graph, args.out))]


def _placement_steps(args: argparse.Namespace) -> list:
    from baige_ray.ops.plots import plot_placement
    from baige_ray.planner.model_spec import load_model_spec
    from baige_ray.planner.plan import plan

    if args.max_nodes < 1:
        raise ValueError(f"--max-nodes={args.max_nodes} is invalid: expected an integer >= 1")
    return [
        ("graph", lambda _: _graph(args.cluster)),
        ("plan", lambda graph: (graph, plan(load_model_spec(args.model), graph))),
        ("draw", lambda made: plot_placement(made[1], made[0], args.out, max_nodes=args.max_nodes)),
    ]


def _timeline_steps(args: argparse.Namespace) -> list:
    from baige_ray.ops.events import read_events
    from baige_ray.ops.plots import plot_timeline

    return [("read", lambda _: read_events(args.events)), ("draw", lambda events: plot_timeline(events, args.out))]


def _graph(cluster: str):
    from baige_ray.topology.descriptor import load_descriptor
    from baige_ray.topology.graph import ResourceGraph

    return ResourceGraph.from_descriptor(load_descriptor(cluster))
