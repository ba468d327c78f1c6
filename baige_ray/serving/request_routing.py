"""How Serve's routers (in the proxy, in every handle) retry placing a request while the replicas they try
are full: the deployment option every application `serve()` binds carries.

Serve backs a routing task off up to 0.5 s between attempts, and a task that places the queue's oldest
request instead of its own keeps its backoff. So after a burst larger than the replicas hold, each of the
router's tasks (two per replica) places about one request per 0.5 s while the replicas idle: two replicas
answered 8 requests/s against the 96-122 they answer when saturated, until the clients timed out
(docs/benchmarks.md, found by `bench soak --seed 3`). A 20-ms ceiling puts that floor at 100 requests/s
per replica, above what a replica answers; a replica that really is full is asked again 50 times a second.
"""

from __future__ import annotations

from typing import Any

ROUTER_BACKOFF = {"initial_backoff_s": 0.005, "backoff_multiplier": 2.0, "max_backoff_s": 0.02}


def request_router_config(**router: Any) -> dict:
    """The deployment option: Serve's router (or `router`'s class and kwargs) with ROUTER_BACKOFF."""
    from ray.serve.config import RequestRouterConfig

    return {"request_router_config": RequestRouterConfig(**ROUTER_BACKOFF, **router)}
