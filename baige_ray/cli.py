"""The `baige-ray` command line: one subcommand per job, each registered by its own module.

A command module exposes `register(subparsers)` and sets `func` on its parser;
imports stay lazy so `baige-ray --help` does not pay for torch and Ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from baige_ray import __version__

# subcommand -> module that registers it
COMMAND_MODULES = {
    "fit": "baige_ray.commands.fit",
    "bench": "baige_ray.bench.cli",
    "topo": "baige_ray.commands.topo",
    "plan": "baige_ray.commands.plan",
    "calibrate": "baige_ray.commands.calibrate",
    "status": "baige_ray.commands.status",
    "plot": "baige_ray.commands.plot",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baige-ray", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"baige-ray {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as error:
        print(f"baige-ray {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
