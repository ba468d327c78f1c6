"""`baige-ray topo [--cluster NAME|FILE] [--json] [--png FILE]`: show the cluster's resource graph.

With --cluster, the graph comes straight from the descriptor (no Ray). Without
it, baige-ray connects to RAY_ADDRESS (or a local Ray), runs the live topology.s
probes on every node and shows what the hardware reports.
"""

from __future__ import annotations

import argparse
import json

from baige_ray.topology.graph import ResourceGraph


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("topo", help="show the cluster topology: nodes, islands, rails, link tiers")
    parser.add_argument("--cluster", help="a hardware descriptor's name (h100-rail-2048, ...) or YAML path; default: probe the "
                                           "live cluster")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    parser.add_argument("--png", help="also draw the hierarchy into this PNG file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from baige_ray.topology.render import render_png
    from baige_ray.topology.summary import render_text, summarize_graph

    graph = _graph(args.cluster)
    summary = summarize_graph(graph)
    if args.png:
        summary["png"] = str(render_png(graph, args.png))
    print(json.dumps(summary) if args.json else render_text(summary))
    return 0


def _graph(cluster: str | None) -> ResourceGraph:
    if cluster:
        from baige_ray.topology.descriptor import load_descriptor

        return ResourceGraph.from_descriptor(load_descriptor(cluster))
    from baige_ray.topology.connect import open_cluster
    from baige_ray.topology.live import LiveTopology

    with open_cluster(None):
        # In-process: one look at the cluster needs no long-lived actor, only the pinned probes.
        return LiveTopology().graph()
