"""open_cluster's arguments are checked before any Ray process starts, and a simulated cluster's head
carries the dashboard port it was given (a second cluster on one machine needs its own)."""

from __future__ import annotations

import pytest

from baige_ray.topology.connect import open_cluster
from baige_ray.topology.descriptor import load_descriptor
from baige_ray.topology.simulated import SimulatedCluster
from tests.conftest import SIM_2X4


@pytest.mark.parametrize("port", [0, 70_000, "8266"])
def test_a_dashboard_port_that_is_no_tcp_port_is_refused_naming_it(port):
    with pytest.raises(ValueError, match=f"dashboard_port={port!r} is invalid"):
        with open_cluster(SIM_2X4, dashboard_port=port):
            pass


def test_the_simulated_head_node_gets_the_dashboard_port(monkeypatch):
    started = {}

    class RecordingCluster:
        def __init__(self, initialize_head, head_node_args):
            started.update(head_node_args)
            raise RuntimeError("recorded")  # nothing is started

    monkeypatch.setattr("baige_ray.topology.simulated.Cluster", RecordingCluster)
    with pytest.raises(RuntimeError, match="recorded"):
        SimulatedCluster(load_descriptor(SIM_2X4), dashboard_port=8266).start()
    assert started["dashboard_port"] == 8266
    started.clear()
    with pytest.raises(RuntimeError, match="recorded"):
        SimulatedCluster(load_descriptor(SIM_2X4)).start()
    assert "dashboard_port" not in started
