"""The environment a worker process's host allocator starts with (engines/host_allocator.py says why),
and what a Ray node baige-ray starts puts in every worker's environment. Apart from the engines so
that the topology layer, which starts the simulated nodes, can read it."""

from __future__ import annotations

import os

from baige_ray.api.configs import HOST_ALLOCATORS

# The label a Ray node carries when every worker it starts has that host allocator's environment.
HOST_ALLOCATOR_LABEL = "baige-ray.io/host-allocator"
NODE_HOST_ALLOCATOR = "cached"  # the one the nodes baige-ray starts set: ScalingConfig's default

_MMAP_THRESHOLD = 32 << 20  # the most glibc accepts
_NEVER_TRIM = str(2**62)
_GLIBC = {
    "cached": {
        "MALLOC_ARENA_MAX": "1",  # the actor's method thread shares the main arena
        "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD),  # fixed: glibc's own moves with the blocks freed
        "MALLOC_TRIM_THRESHOLD_": _NEVER_TRIM,
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",  # mapped blocks ask for transparent huge pages
    },
    "retain": {
        "MALLOC_ARENA_MAX": "1",
        "MALLOC_MMAP_MAX_": "0",  # large blocks come from the heap too, and go back to it when freed
        "MALLOC_TRIM_THRESHOLD_": _NEVER_TRIM,
    },
    "system": {},
}


def allocator_env_vars(host_allocator: str) -> dict[str, str]:
    """The environment a worker process starts with for `host_allocator` (glibc reads it at start-up,
    so it cannot be set from inside a running actor)."""
    if host_allocator not in HOST_ALLOCATORS:
        raise ValueError(f"host_allocator={host_allocator!r} is invalid: expected one of {HOST_ALLOCATORS}")
    env_vars = dict(_GLIBC[host_allocator])
    own_tunables = os.environ.get("GLIBC_TUNABLES")
    if own_tunables and "GLIBC_TUNABLES" in env_vars:  # add to the tunables this process was given
        env_vars["GLIBC_TUNABLES"] = f"{own_tunables}:{env_vars['GLIBC_TUNABLES']}"
    return env_vars


def node_environment(host_allocator: str = NODE_HOST_ALLOCATOR) -> dict:
    """`env_vars` and `labels` for a Ray node baige-ray starts (`ray.cluster_utils.Cluster.add_node`):
    every worker process of the node starts with `host_allocator`'s environment."""
    return {"env_vars": allocator_env_vars(host_allocator), "labels": {HOST_ALLOCATOR_LABEL: host_allocator}}
