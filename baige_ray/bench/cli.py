"""`baige-ray bench NAME [--json]`: run a benchmark; the JSON result is always the last line."""

from __future__ import annotations

import argparse
import importlib
import json

# benchmark name -> module exposing `run(args) -> dict` and optionally `add_arguments(parser)`.
# Benchmark modules keep heavy imports inside `run`, so parsing stays fast.
BENCHMARK_MODULES: dict[str, str] = {
    "api": "baige_ray.bench.api",
    "colocate": "baige_ray.bench.colocate",
    "topo": "baige_ray.bench.topo",
    "plan": "baige_ray.bench.plan",
    "planner": "baige_ray.bench.planner",
    "planner-host": "baige_ray.bench.planner_host",
    "hetero": "baige_ray.bench.hetero",
    "overhead": "baige_ray.bench.overhead",
    "checkpoint": "baige_ray.bench.checkpoint",
    "recovery": "baige_ray.bench.recovery",
    "serve": "baige_ray.bench.serve",
    "moe": "baige_ray.bench.moe",
    "pd": "baige_ray.bench.pd",
    "scale": "baige_ray.bench.scale",
    "prefix": "baige_ray.bench.prefix",
    "longctx": "baige_ray.bench.longctx",
    "ettr": "baige_ray.bench.ettr",
    "rl": "baige_ray.bench.rl",
    "sft": "baige_ray.bench.sft",
    "soak": "baige_ray.bench.soak",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark; the last output line is JSON")
    benchmarks = parser.add_subparsers(dest="benchmark", required=True)
    for name, module_name in sorted(BENCHMARK_MODULES.items()):
        module = importlib.import_module(module_name)
        sub = benchmarks.add_parser(name, help=(module.__doc__ or name).strip().splitlines()[0])
        sub.add_argument("--json", action="store_true", help="print only the JSON result line")
        if hasattr(module, "add_arguments"):
            module.add_arguments(sub)
        sub.set_defaults(func=lambda args, module=module: _run(module, args))


def _run(module, args: argparse.Namespace) -> int:
    from baige_ray.runtime.progress import StageProgress

    # On stderr: the JSON line on stdout stays the last, whatever a benchmark reports on the way.
    with StageProgress(f"bench {args.benchmark}") as progress:
        args.progress = progress
        progress("running", 0, 1)
        result = module.run(args)
    if not args.json and hasattr(module, "summarize"):
        print(module.summarize(result))
    print(json.dumps(result))
    return 0
