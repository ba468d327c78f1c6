"""Connect to the user's Ray cluster, or simulate one from a descriptor."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import ray

from baige_ray.api.connection import connect_ray
from baige_ray.constants import ray_address
from baige_ray.topology.descriptor import ClusterDescriptor, load_descriptor
from baige_ray.topology.simulated import SimulatedCluster


@dataclass(frozen=True)
class ClusterSession:
    address: str
    simulated: bool
    descriptor: ClusterDescriptor | None


@contextmanager
def open_cluster(
    descriptor: str | Path | ClusterDescriptor | None = None,
    *,
    local_num_cpus: int | None = None,
    local_num_gpus: int | None = None,
    log_to_driver: bool = True,
    dashboard_port: int | None = None,
) -> Iterator[ClusterSession]:
    """Yield a connected Ray session and shut it down afterwards.

    With RAY_ADDRESS set (a cluster from `ray start --head`), connect to it and
    leave it running. Otherwise start a simulated cluster from `descriptor`, or a
    plain local Ray instance (with `local_num_cpus` / `local_num_gpus`, fake GPUs
    allowed) when no descriptor is given. With `log_to_driver=False` the workers'
    output stays in Ray's log files instead of this terminal. `dashboard_port` is where a cluster this
    starts serves its dashboard and state API (Ray's default, 8265, when None): a second cluster on the
    same machine needs a port of its own, or it runs without them.
    """
    dashboard = _dashboard_args(dashboard_port)
    if isinstance(descriptor, (str, Path)):
        descriptor = load_descriptor(descriptor)
    address = ray_address()
    if address is not None:
        connect_ray(address, logging_level=logging.WARNING, log_to_driver=log_to_driver)
        try:
            yield ClusterSession(address=address, simulated=False, descriptor=descriptor)
        finally:
            ray.shutdown()
        return
    if descriptor is None:
        # address="local": start a fresh instance even if another `ray start` runs on this machine.
        context = ray.init(
            address="local", num_cpus=local_num_cpus, num_gpus=local_num_gpus, logging_level=logging.WARNING,
            log_to_driver=log_to_driver, **dashboard,
        )
        try:
            yield ClusterSession(address=context.address_info["address"], simulated=False, descriptor=None)
        finally:
            ray.shutdown()
        return
    with SimulatedCluster(descriptor, log_to_driver=log_to_driver, dashboard_port=dashboard_port) as cluster:
        yield ClusterSession(address=cluster.address, simulated=True, descriptor=descriptor)


def _dashboard_args(dashboard_port: int | None) -> dict:
    if dashboard_port is None:
        return {}
    if not isinstance(dashboard_port, int) or not 0 < dashboard_port < 65536:
        raise ValueError(f"dashboard_port={dashboard_port!r} is invalid: expected a TCP port, 1 to 65535")
    return {"dashboard_port": dashboard_port}
