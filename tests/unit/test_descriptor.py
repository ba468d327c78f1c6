import pytest
import yaml

from baige_ray.topology.descriptor import descriptor_from_dict, load_descriptor
from baige_ray.topology.simulated import SimulatedCluster, node_args

from ..conftest import SIM_2X4


def test_sim_2x4_loads():
    descriptor = load_descriptor(SIM_2X4)
    assert descriptor.num_nodes == 2
    assert descriptor.num_devices == 8
    assert [t.num_devices for t in descriptor.node_type_sequence()] == [4, 4]


def test_simulated_node_advertises_fake_gpus_and_markers():
    node_type = load_descriptor(SIM_2X4).node_type_sequence()[1]
    args = node_args(node_type, 1, cpus_per_device=1.0)
    assert args["num_gpus"] == 4
    assert args["resources"]["baige_node_1"] == 1.0
    assert args["resources"][f"baige_chip_{node_type.chip.model}"] == 4.0


def test_a_simulated_node_index_names_its_type_and_a_wrong_one_is_refused():
    cluster = SimulatedCluster(load_descriptor(SIM_2X4))  # not started: nothing runs yet
    assert cluster.node_type_of(1) == "sim-a100-node" and cluster.worker_node_indices == []
    with pytest.raises(ValueError, match="index=2 is invalid"):
        cluster.node_type_of(2)


def _raw():
    return yaml.safe_load(SIM_2X4.read_text())


def test_unknown_node_type_is_named():
    raw = _raw()
    raw["nodes"][0]["type"] = "dgx-z"
    with pytest.raises(ValueError, match=r"NodeGroup.type='dgx-z' is invalid"):
        descriptor_from_dict(raw)


def test_unknown_key_is_named():
    raw = _raw()
    raw["node_types"]["sim-a100-node"]["gpus"] = 4
    with pytest.raises(ValueError, match=r"unknown keys \['gpus'\]"):
        descriptor_from_dict(raw)


def test_nic_serving_missing_device_is_rejected():
    raw = _raw()
    raw["node_types"]["sim-a100-node"]["nics"][0]["devices"] = [0, 9]
    with pytest.raises(ValueError, match=r"devices=\[0, 9\] is invalid"):
        descriptor_from_dict(raw)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="expected an existing YAML file"):
        load_descriptor(tmp_path / "nope.yaml")
