"""Ray Serve's own throughput settings, in Serve's processes only.

Serve reads two settings from each process's environment (part of its RAY_SERVE_THROUGHPUT_OPTIMIZED): the
proxy streams a replica's answer over gRPC instead of Ray object references, and a handle's router runs on
its caller's event loop instead of a thread of its own. `serve()` starts Serve's controller with them in its
runtime environment, which the proxies and replicas it creates inherit; the caller's process keeps Serve's
defaults, because a router on the caller's loop breaks a handle used under `asyncio.run` more than once (each
run closes the loop the router was bound to). A value the user put in the environment is kept. Measured
with `baige-ray bench api` (serve(engine="vllm"), output tokens/s over HTTP at 8 streams on the CPU machine,
2026-12-07): 626 without them, 832-922 in four runs with them in Serve's processes (`vllm serve`: 1,409-1,449).
"""

from __future__ import annotations

import os

SERVE_THROUGHPUT_ENV = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def controller_options() -> dict:
    """`serve.start(controller_options=...)`: the settings for Serve's controller and what it starts."""
    env_vars = {name: os.environ.get(name, value) for name, value in SERVE_THROUGHPUT_ENV.items()}
    return {"runtime_env": {"env_vars": env_vars}}
