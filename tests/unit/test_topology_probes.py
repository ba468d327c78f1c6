"""Probe parsers on recorded `nvidia-smi` text, fake sysfs trees and a fake NVML module."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from baige_ray.topology.descriptor import NetworkSpec
from baige_ray.topology.graph import LinkTier, ResourceGraph
from baige_ray.topology.probe_node import chip_facts, probe_node, profile_from_probe
from baige_ray.topology.probe_nvml import probe_nvml
from baige_ray.topology.probe_smi import parse_gpu_query, parse_topo_matrix
from baige_ray.topology.probe_sysfs import pci_distance, read_hcas, read_netdevs
from baige_ray.topology.probe_types import PciDistance, assign_rails, choose_nics, normalize_bus_id

from .fixtures.fake_sysfs import add_hca, add_pci_function, hgx_like_tree

pytestmark = pytest.mark.unit
FIXTURES = Path(__file__).parent / "fixtures"


def _topo(name: str):
    return parse_topo_matrix((FIXTURES / f"nvidia_smi_topo_{name}.txt").read_text())


def test_nvswitch_8_gpus_all_nv18_is_one_island_and_eight_rails():
    matrix = _topo("h100_nvswitch")
    assert matrix.gpus == tuple(f"GPU{i}" for i in range(8))
    assert matrix.nics == tuple(f"mlx5_{i}" for i in range(10))  # NIC legend resolved
    assert matrix.nvlink_count("GPU0", "GPU7") == 18
    assert matrix.islands() == (tuple(range(8)),)
    assert matrix.numa_of_gpu == (0, 0, 0, 0, 1, 1, 1, 1)
    # mlx5_4/5 (frontend, storage) are nearest to no GPU, so they take no rail number.
    assert choose_nics(matrix.nic_distance(), matrix.nics) == (
        "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9")
    assert assign_rails(matrix.nic_distance(), matrix.nics) == tuple(range(8))


def test_pcie_only_has_one_island_per_gpu_and_a_shared_nic():
    matrix = _topo("pcie_only")
    assert matrix.islands() == ((0,), (1,), (2,), (3,))
    assert matrix.links[("GPU0", "mlx5_0")] == "PXB"
    assert assign_rails(matrix.nic_distance(), matrix.nics) == (0, 0, 0, 0)


def test_mixed_nvlink_pairs_old_header_without_nic_legend():
    matrix = _topo("mixed_nvlink_pairs")
    assert matrix.nics == ("mlx5_0", "mlx5_1")
    assert matrix.islands() == ((0, 1), (2, 3))
    assert assign_rails(matrix.nic_distance(), matrix.nics) == (0, 0, 1, 1)


def test_parse_topo_rejects_text_without_a_matrix():
    with pytest.raises(ValueError, match="header row"):
        parse_topo_matrix("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_gpu_query_csv():
    gpus = parse_gpu_query((FIXTURES / "nvidia_smi_query_h100.csv").read_text())
    assert len(gpus) == 8 and gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus[0].memory_gb == pytest.approx(85.5, abs=0.1)  # 81559 MiB, in GB (1e9 bytes) as the planner counts
    assert gpus[1].pci_bus_id == "0000:2a:00.0"


def test_tied_nics_are_shared_round_robin_like_nccl():
    # DGX A100: two GPUs and two NICs under one switch, all PXB to each other.
    distance = [[1, 1, 4, 4], [1, 1, 4, 4], [4, 4, 1, 1], [4, 4, 1, 1]]
    assert choose_nics(distance, ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]) == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    assert assign_rails([[], []], []) == (-1, -1)


def test_bus_id_normalization():
    assert normalize_bus_id(b"00000000:1A:00.0") == "0000:1a:00.0"
    assert normalize_bus_id("0000:1a:00.0") == "0000:1a:00.0"


def test_sysfs_hcas_netdevs_and_pci_distance(tmp_path):
    gpus = hgx_like_tree(tmp_path)
    hcas = read_hcas(tmp_path)
    assert [h.name for h in hcas] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert hcas[0].rate_gbps == 400.0 and hcas[0].link_layer == "InfiniBand" and hcas[0].active
    assert hcas[2].numa_node == 1 and hcas[0].netdev.startswith("ibp")
    assert len(read_netdevs(tmp_path)) == 4
    assert pci_distance(tmp_path, gpus["0"], hcas[0].pci_bus_id) == PciDistance.PIX
    assert pci_distance(tmp_path, gpus["0"], hcas[1].pci_bus_id) == PciDistance.PHB
    assert pci_distance(tmp_path, gpus["0"], hcas[2].pci_bus_id) == PciDistance.SYS


def test_sysfs_roce_and_missing_tree(tmp_path):
    assert read_hcas(tmp_path / "nothing") == ()
    nic = add_pci_function(tmp_path, ["pci0000:00", "0000:00:01.0", "0000:01:00.0"], 0)
    add_hca(tmp_path, "mlx5_bond_0", nic, rate="100 Gb/sec (2X HDR)", link_layer="Ethernet", state="1: DOWN")
    (hca,) = read_hcas(tmp_path)
    assert hca.link_layer == "Ethernet" and hca.rate_gbps == 100.0 and not hca.active


def _fake_nvml(num_gpus: int, linked_pairs: set[frozenset[int]], bus_ids: list[str]):
    handles = list(range(num_gpus))
    return SimpleNamespace(
        NVML_P2P_CAPS_INDEX_NVLINK=3, NVML_P2P_STATUS_OK=0,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: num_gpus,
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetName=lambda h: b"NVIDIA A100-SXM4-80GB",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * 2**30),
        nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId=("0000" + bus_ids[h]).encode()),
        nvmlDeviceGetP2PStatus=lambda a, b, cap: 0 if frozenset((a, b)) in linked_pairs else 4,
    )


def test_nvml_probe_with_a_fake_library():
    pairs = {frozenset((a, b)) for a in range(4) for b in range(4) if a != b}
    gpus, islands = probe_nvml(_fake_nvml(4, pairs, [f"0000:{0x17 + i:02x}:00.0" for i in range(4)]))
    assert [g.pci_bus_id for g in gpus] == ["0000:17:00.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"]
    assert islands == ((0, 1, 2, 3),) and gpus[0].memory_gb == pytest.approx(85.9, abs=0.1)  # 80 GiB


def test_nvml_absent_or_failing_returns_none():
    def fail():
        raise RuntimeError("NVML Shared Library Not Found")

    assert probe_nvml(SimpleNamespace(nvmlInit=fail)) is None


def test_probe_node_end_to_end_on_fake_hardware(tmp_path):
    bus = hgx_like_tree(tmp_path)
    pairs = {frozenset((a, b)) for a in range(4) for b in range(4) if a != b}
    nvml = _fake_nvml(4, pairs, [bus[str(i)] for i in range(4)])
    probe = probe_node(tmp_path, nvml=nvml, smi=lambda *a: None)
    assert probe.source == "nvml" and probe.rail_of_gpu == (0, 1, 2, 3)
    assert [g.numa_node for g in probe.gpus] == [0, 0, 1, 1]  # from sysfs, NVML gave none
    profile = profile_from_probe(probe, NetworkSpec(nodes_per_leaf=2, leaves_per_pod=1))
    assert profile.fabric == "nvswitch" and profile.relative_speed == 1.0 and profile.nic_gbps_of_device == (400.0,) * 4
    graph = ResourceGraph.from_profiles({"a": profile}, {"a": [0, 1]}, NetworkSpec(nodes_per_leaf=2))
    assert graph.tier_between(0, 4) == LinkTier.SAME_RAIL and graph.tier_between(0, 5) == LinkTier.CROSS_RAIL


def test_probe_node_falls_back_to_nvidia_smi_then_cpu_only(tmp_path):
    outputs = {"topo": (FIXTURES / "nvidia_smi_topo_mixed_nvlink_pairs.txt").read_text(),
               "query": "0, NVIDIA RTX A6000, 49140, 00000000:17:00.0\n1, NVIDIA RTX A6000, 49140, 00000000:18:00.0\n"
                        "2, NVIDIA RTX A6000, 49140, 00000000:97:00.0\n3, NVIDIA RTX A6000, 49140, 00000000:98:00.0\n"}
    smi = lambda *args: outputs["topo" if args[0] == "topo" else "query"]  # noqa: E731
    probe = probe_node(tmp_path, nvml=SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(OSError())), smi=smi)
    assert probe.source == "nvidia-smi" and probe.islands == ((0, 1), (2, 3))
    assert [g.numa_node for g in probe.gpus] == [0, 0, 1, 1]
    assert profile_from_probe(probe, NetworkSpec()).fabric == "nvlink"
    cpu = probe_node(tmp_path, nvml=SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(OSError())),
                     smi=lambda *a: None)
    assert cpu.cpu_only and cpu.source == "none"
    cpu_profile = profile_from_probe(cpu, NetworkSpec())
    graph = ResourceGraph.from_profiles({"cpu": cpu_profile}, {"cpu": [0]}, NetworkSpec())
    assert graph.num_devices == 0 and graph.cpu_only_nodes().tolist() == [0]


def test_chip_facts_prefers_specific_names():
    assert chip_facts("NVIDIA H100 80GB HBM3").relative_speed == 3.0
    assert chip_facts("NVIDIA A100-SXM4-40GB").nvlink_gbps == 2400
    assert chip_facts("Mystery GPU").relative_speed == 1.0
