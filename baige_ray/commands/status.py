"""`baige-ray status [--name RUN] [--json]`: state, plan, workers, events, step rate and goodput of a job.

Connects to RAY_ADDRESS, or to the Ray cluster running on this machine
(`address="auto"`); never starts one.
"""

from __future__ import annotations

import argparse
import json
import logging


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show a running training job: state, plan, workers, events")
    parser.add_argument("--name", help="run name (RunConfig.name); default: the only running job")
    parser.add_argument("--json", action="store_true", help="print the controller's status dict as JSON")
    parser.add_argument("--events", type=int, default=10, help="how many recent events to show")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import ray

    from baige_ray.api.connection import connect_ray
    from baige_ray.constants import ray_address
    from baige_ray.ops.status import fetch_status, format_status

    if args.events < 0:
        raise ValueError(f"--events={args.events} is invalid: expected an integer >= 0")
    already_connected = ray.is_initialized()
    if not already_connected:
        address = ray_address() or "auto"
        try:
            connect_ray(address, logging_level=logging.WARNING, log_to_driver=False)
        except ConnectionError as error:
            raise ValueError(f"no Ray cluster at address={address!r} ({error}); set RAY_ADDRESS "
                             "or start one with `ray start --head`") from error
    try:
        status = fetch_status(args.name)
    finally:
        if not already_connected:
            ray.shutdown()
    print(json.dumps(status, default=str) if args.json else format_status(status, num_events=args.events))
    return 0
