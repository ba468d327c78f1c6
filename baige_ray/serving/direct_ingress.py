"""Each replica answering HTTP on a port of its own, beside Serve's proxy: Ray Serve's direct ingress.

Behind Serve's proxy every streamed piece of an answer crosses two processes: the replica hands it to the
proxy, which writes it to the client. `vllm serve` writes it from the process that made it. With
`serve(..., direct_ingress=True)` Ray Serve starts an HTTP server inside each replica of the application's
HTTP deployment (RAY_SERVE_ENABLE_DIRECT_INGRESS, set for those replicas only) on a port Serve's controller
hands out (30000-31000 by default, RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT / MAX_HTTP_PORT), on the host
Serve's proxy binds (127.0.0.1 unless told otherwise). The routes are the application's, under its route
prefix; the proxy keeps answering as well. A client of one replica gets the path `vllm serve` has; a
client spreading requests over several replicas balances them itself (Ray's own deployment of this puts
HAProxy in front).
"""

from __future__ import annotations

import time

import ray

DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
# How long a stopping replica keeps its port open for a load balancer in front to notice (Ray's default 30 s,
# for its HAProxy); clients here reach the port themselves, and Serve still waits for ongoing requests.
DRAINING_ENV, DRAINING_S = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def with_direct_ingress(actor_options: dict) -> dict:
    """`actor_options` whose runtime environment turns on Serve's direct ingress in the replica (with a short
    draining period, unless the caller's own environment variables set one)."""
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {DRAINING_ENV: DRAINING_S, **(runtime_env.get("env_vars") or {}), DIRECT_INGRESS_ENV: "1"}
    return {**actor_options, "runtime_env": runtime_env}


def replica_urls(app_name: str, route_prefix: str, host: str, *, expected: int,
                 timeout_s: float = 30.0) -> tuple[str, ...]:
    """The URL (route prefix included) of each running replica's own HTTP server, once `expected` of them
    have a port. `host` is what Serve binds: on a loopback address the URLs are the loopback's."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    deadline = time.monotonic() + timeout_s
    while True:
        # Serve's controller lists the running ingress replicas' ports under the application's name
        # (ray 2.60; its public get_target_groups lists them only where the whole instance runs direct ingress).
        groups = ray.get(controller._get_target_groups_for_app.remote(app_name, route_prefix))
        targets = [target for group in groups if str(group.protocol).upper().endswith("HTTP")
                   for target in group.targets]
        if len(targets) >= expected:
            prefix = route_prefix.rstrip("/")
            return tuple(f"http://{_reachable(host, target.ip)}:{target.port}{prefix}"
                         for target in sorted(targets, key=lambda target: target.port))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{app_name}: {len(targets)} of {expected} replicas have a port of their own "
                               f"after {timeout_s:g}s")
        time.sleep(0.2)


def _reachable(bound: str, node_ip: str) -> str:
    return "127.0.0.1" if bound in _LOOPBACK else node_ip
