"""Discovery rules, the TopologyActor in-process (fake node table), descriptor checks and the topo CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from baige_ray.actors.topology import TopologyActor
from baige_ray.cli import main
from baige_ray.topology.descriptor import descriptor_from_dict, load_descriptor
from baige_ray.topology.discovery import assign_node_ids, simulated_nodes
from baige_ray.topology.probe_types import GpuInfo, NodeProbe

pytestmark = pytest.mark.unit
SIM_2X4 = Path(__file__).resolve().parents[2] / "clusters" / "sim-2x4.yaml"


def _ray_node(node_id: str, index: int | None = None, alive: bool = True, address: str = "10.0.0.1") -> dict:
    resources = {"CPU": 5.0, "GPU": 4.0}
    if index is not None:
        resources.update({f"baige_node_{index}": 1.0, "baige_type_sim-a100-node": 1.0})
    return {"NodeID": node_id, "Alive": alive, "Resources": resources, "NodeManagerAddress": address}


def test_simulated_nodes_match_by_resource_and_skip_dead_ones():
    found = simulated_nodes([_ray_node("a", 0), _ray_node("b", 1, alive=False), _ray_node("c")], ["sim-a100-node"])
    assert {i: n.ray_node_id for i, n in found.items()} == {0: "a"}
    with pytest.raises(ValueError, match="one live node per index"):
        simulated_nodes([_ray_node("a", 0), _ray_node("b", 0)], ["sim-a100-node"])
    with pytest.raises(ValueError, match="baige_type_sim-a100-node is invalid"):
        simulated_nodes([_ray_node("a", 0)], ["other"])


def test_real_node_ids_are_stable_when_nodes_leave():
    first = assign_node_ids([_ray_node("x", address="10.0.0.2"), _ray_node("y", address="10.0.0.1")], {})
    assert first == {"y": 0, "x": 1}
    after = assign_node_ids([_ray_node("x", address="10.0.0.2"), _ray_node("z", address="10.0.0.0")], first)
    assert after == {"x": 1, "z": 2}


def test_actor_follows_simulated_membership_in_process():
    nodes = [_ray_node("a", 0), _ray_node("b", 1)]
    actor = TopologyActor(descriptor=load_descriptor(SIM_2X4), list_nodes=lambda: nodes, start_polling=False)
    assert actor.version() == 1 and actor.graph().num_devices == 8
    assert actor.graph().nodes.names == ("a", "b")
    nodes[1] = _ray_node("b", 1, alive=False)
    assert actor.refresh() == 2 and actor.graph().node_ids.tolist() == [0]
    assert actor.refresh() == 2  # no change, no new version
    nodes.append(_ray_node("c", 2))
    assert actor.refresh() == 3 and actor.graph().node_ids.tolist() == [0, 2]
    assert actor.membership() == {0: "a", 2: "c"}


def test_actor_probes_only_new_real_nodes():
    calls = []

    def run_probes(ids):
        calls.append(list(ids))
        return {i: NodeProbe(hostname=i, num_cpus=4, memory_gb=8.0,
                             gpus=(GpuInfo(index=0, name="NVIDIA L4", memory_gb=24.0),)) for i in ids}

    nodes = [_ray_node("a"), _ray_node("b", address="10.0.0.2")]
    actor = TopologyActor(list_nodes=lambda: nodes, run_probes=run_probes, start_polling=False)
    assert actor.graph().num_devices == 2 and calls == [["a", "b"]]
    nodes.append(_ray_node("c", address="10.0.0.3"))
    actor.refresh()
    assert calls == [["a", "b"], ["c"]] and actor.graph().num_nodes == 3


def test_descriptor_island_and_numa_validation():
    raw = yaml.safe_load(SIM_2X4.read_text())
    raw["node_types"]["sim-a100-node"]["intra_node"]["islands"] = [[0, 1]]
    with pytest.raises(ValueError, match="islands.*expected islands only with fabric 'nvlink'"):
        descriptor_from_dict(raw)
    raw["node_types"]["sim-a100-node"]["intra_node"].update(fabric="nvlink", islands=[[0, 1], [1, 2, 3]])
    with pytest.raises(ValueError, match=r"devices \[1\] repeat"):
        descriptor_from_dict(raw)
    raw["node_types"]["sim-a100-node"]["intra_node"]["islands"] = [[0, 1]]
    with pytest.raises(ValueError, match="covering every device"):
        descriptor_from_dict(raw)
    del raw["node_types"]["sim-a100-node"]["intra_node"]["islands"]
    raw["node_types"]["sim-a100-node"]["device_numa"] = [0, 1]
    with pytest.raises(ValueError, match="device_numa"):
        descriptor_from_dict(raw)


def test_topo_cli_json_and_png(tmp_path, capsys):
    png = tmp_path / "topo.png"
    assert main(["topo", "--cluster", str(SIM_2X4), "--json", "--png", str(png)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_devices"] == 8 and summary["num_islands"] == 2 and summary["rails"] == {"0": 4, "1": 4}
    assert [row["tier"] for row in summary["tiers"]] == ["NVLINK", "SAME_RAIL", "CROSS_RAIL"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["topo", "--cluster", str(SIM_2X4)]) == 0
    assert "link tiers" in capsys.readouterr().out
