"""Subgroups of a generation's process group (device meshes, a pipeline's end pairs) whose members connect
under a short timeout, then run their collectives under the generation's own.

A new group connects its members when it is created (gloo), under the timeout it is created with;
torch's default for subgroups is 30 minutes. Every member is alive when a generation's default group
forms (parallel/distributed.py), but one can die before the engine builds its meshes, and its peers
would wait in that connect, where nothing interrupts them, for the whole default. Connecting takes
milliseconds among live members, so `GROUP_CONNECT_TIMEOUT_S` bounds it as it bounds the default group's.
NCCL connects a communicator at its first collective unless the group is bound to a device; there the
short timeout applies only where creation connects.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from baige_ray.parallel.distributed import GROUP_CONNECT_TIMEOUT_S


def subgroup(ranks: list[int], connect_timeout_s: float = GROUP_CONNECT_TIMEOUT_S) -> dist.ProcessGroup:
    """`dist.new_group(ranks)` (collective: every rank calls it, in the same order) connected under
    `connect_timeout_s`; its members then wait on its collectives as long as on the default group's."""
    collective = collective_timeout()
    group = dist.new_group(ranks, timeout=_connect_timeout(connect_timeout_s, collective))
    if dist.get_rank() in ranks:
        dist.distributed_c10d._set_pg_timeout(collective, group)
    return group


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...],
                connect_timeout_s: float = GROUP_CONNECT_TIMEOUT_S) -> DeviceMesh:
    """`init_device_mesh` whose dimensions' groups connect under `connect_timeout_s`, then wait on their
    collectives as long as on the default group's. A one-dimensional mesh of every rank is the default
    group itself, already connected."""
    if (len(shape) == 1 and shape[0] == dist.get_world_size()) or dist.get_backend() not in _OPTIONS:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    collective = collective_timeout()
    connect = _connect_timeout(connect_timeout_s, collective)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names,
                            backend_override={name: _connect_options(connect) for name in names})
    for name in names:
        dist.distributed_c10d._set_pg_timeout(collective, mesh.get_group(name))
    return mesh


def flattened(mesh: DeviceMesh, name: str, connect_timeout_s: float = GROUP_CONNECT_TIMEOUT_S) -> DeviceMesh:
    """`mesh._flatten(name)` (the dimensions of `mesh` as one) connected as `device_mesh`'s are."""
    if dist.get_backend() not in _OPTIONS:
        return mesh._flatten(name)
    collective = collective_timeout()
    flat = mesh._flatten(name, backend_override=_connect_options(_connect_timeout(connect_timeout_s, collective)))
    dist.distributed_c10d._set_pg_timeout(collective, flat.get_group())
    return flat


def collective_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """The timeout `group`'s (default: the default group's) collectives run under."""
    group = group or dist.distributed_c10d._get_default_group()
    device = dist.distributed_c10d._get_pg_default_device(group)
    return group._get_backend(device).options._timeout


def _connect_timeout(connect_timeout_s: float, collective: datetime.timedelta) -> datetime.timedelta:
    return min(datetime.timedelta(seconds=connect_timeout_s), collective)


# Per backend, the options a mesh dimension's group is created with (a mixed or plug-in backend: none, and
# its meshes connect under torch's default).
_OPTIONS = {"gloo": lambda: dist.ProcessGroupGloo._Options(), "nccl": lambda: dist.ProcessGroupNCCL.Options()}


def _connect_options(timeout: datetime.timedelta):
    """Options of the default group's backend carrying only `timeout` (a mesh takes its groups' timeout from
    them); a fresh object per group, since creating a group writes its name and ranks into them."""
    options = _OPTIONS[dist.get_backend()]()
    options._timeout = timeout
    return options
