"""CPU workers on a one-machine cluster are priced against this host."""

from __future__ import annotations

import socket

import psutil
import pytest

from baige_ray.topology.local_host import is_this_host, local_host_graph


def test_the_local_host_graph_is_cpu_devices_sharing_this_machines_memory():
    graph = local_host_graph(3)
    total_gb = psutil.virtual_memory().total / 1e9
    assert graph.num_devices == 3
    assert graph.profile_of_node(0).host_memory_gb == pytest.approx(total_gb)
    assert graph.profiles[0].accelerator == "cpu"
    assert graph.devices.memory_gb.tolist() == pytest.approx([total_gb] * 3)


def test_only_a_cluster_of_this_machine_alone_is_this_host():
    me = {"Alive": True, "NodeManagerHostname": socket.gethostname()}
    other = {"Alive": True, "NodeManagerHostname": socket.gethostname() + "-other"}
    assert is_this_host([me, {**other, "Alive": False}])
    assert not is_this_host([me, other])
    assert not is_this_host([other])
    assert not is_this_host([])
