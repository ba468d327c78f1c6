"""`baige-ray plan MODEL --cluster CLUSTER [--json]`: choose a parallel layout and explain it.

MODEL is the name of a model config that ships (qwen2.5-0.5b, gpt-175b: examples/models/), a planner YAML, or
a Hugging Face config.json / model directory; a config.json carries no batch or sequence length, so those
come from flags. CLUSTER is the name of a descriptor that ships (h100-rail-2048: clusters/) or a YAML path."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from baige_ray.planner.model_spec import DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ_LEN_CAP

    parser = subparsers.add_parser("plan", help="plan DP/TP/PP/EP, ZeRO, micro-batches and rank placement")
    parser.add_argument("model", help="a shipped model's name (qwen2.5-0.5b, gpt-175b, ...), a model YAML, or a "
                                      "Hugging Face config.json or model directory holding one")
    parser.add_argument("--cluster", required=True, help="a hardware descriptor's name (h100-rail-2048, ...) or "
                                                         "YAML path")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON line")
    parser.add_argument("--top-k", type=int, default=5, help="alternatives to show with why they lost")
    parser.add_argument("--global-batch", type=int, default=None,
                        help=f"sequences per step, for a config.json only (default {DEFAULT_GLOBAL_BATCH})")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence, for a config.json only (default: its max_position_embeddings, "
                             f"or {DEFAULT_SEQ_LEN_CAP} when that is larger)")
    parser.add_argument("--uncalibrated", action="store_true",
                        help="price with the nominal constants even where `baige-ray calibrate` measured this cluster")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from baige_ray.api.errors import InfeasiblePlanError
    from baige_ray.planner.model_spec import load_model_spec
    from baige_ray.planner.options import PlanOptions
    from baige_ray.planner.plan import plan
    from baige_ray.planner.report import explain_text, plan_to_dict
    from baige_ray.runtime.calibration_store import load_calibration
    from baige_ray.runtime.progress import StageProgress
    from baige_ray.topology.descriptor import load_descriptor
    from baige_ray.topology.graph import ResourceGraph

    model = load_model_spec(args.model, global_batch=args.global_batch, seq_len=args.seq_len)
    with StageProgress("plan", enabled=not args.json) as progress:
        progress("the cluster's resource graph", 0, 1)
        graph = ResourceGraph.from_descriptor(load_descriptor(args.cluster))
        calibration = None if args.uncalibrated else load_calibration(graph)
        try:
            chosen = plan(model, graph, PlanOptions(top_k=args.top_k, calibration=calibration), progress=progress)
        except InfeasiblePlanError as error:
            progress.close()  # before the message, which the line would otherwise overwrite
            print(f"baige-ray plan: {error}", file=sys.stderr)
            return 2
    print(json.dumps(plan_to_dict(chosen)) if args.json else explain_text(chosen))
    return 0
