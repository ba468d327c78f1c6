"""ResourceGraph: tiers, bandwidths, islands, rails, group slowest link (against brute force), sub-graphs."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import yaml

from baige_ray.topology.descriptor import descriptor_from_dict, load_descriptor
from baige_ray.topology.graph import LinkTier, ResourceGraph
from baige_ray.topology.groups import slowest_link

pytestmark = pytest.mark.unit
CLUSTERS = Path(__file__).resolve().parents[2] / "clusters"


def _graph(name: str) -> ResourceGraph:
    return ResourceGraph.from_descriptor(load_descriptor(CLUSTERS / f"{name}.yaml"))


def _brute(graph: ResourceGraph, ids) -> tuple[int, float]:
    a, b = np.array(list(itertools.combinations(ids, 2))).T
    return int(np.max(graph.tier_between(a, b))), float(np.min(graph.bandwidth_between(a, b)))


def test_sim_2x4_tiers_and_bandwidths():
    graph = _graph("sim-2x4")
    assert (graph.num_nodes, graph.num_devices) == (2, 8)
    assert [ids.tolist() for ids in graph.islands()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert {r: ids.tolist() for r, ids in graph.rails().items()} == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}
    assert graph.tier_between(0, 3) == LinkTier.NVLINK
    assert graph.tier_between(0, 5) == LinkTier.SAME_RAIL
    assert graph.tier_between(0, 6) == LinkTier.CROSS_RAIL
    assert graph.bandwidth_between(0, 3) == pytest.approx(2400 / 8)
    assert graph.bandwidth_between(0, 5) == pytest.approx(200 / 8)
    assert graph.latency_between(0, 6) == pytest.approx(8.0)


def test_all_shipped_descriptors_build():
    for path in sorted(CLUSTERS.glob("*.yaml")):
        if "provider" in yaml.safe_load(path.read_text()):
            continue  # a `ray up` cluster YAML (tests/unit/test_cluster_yamls.py), not a hardware descriptor
        descriptor = load_descriptor(path)
        graph = ResourceGraph.from_descriptor(descriptor)
        assert graph.num_devices == descriptor.num_devices, path.name


def test_h100_cluster_has_four_pods_and_cross_pod_oversubscription():
    graph = _graph("h100-rail-2048")
    assert graph.num_devices == 16_384 and graph.pods().tolist() == [0, 1, 2, 3]
    first_pod_2 = 2 * 512 * 8
    assert graph.tier_between(0, first_pod_2) == LinkTier.CROSS_POD
    assert graph.bandwidth_between(0, first_pod_2) == pytest.approx(400 / 8 / 2)
    assert graph.tier_between(0, 32 * 8) == LinkTier.CROSS_RAIL  # rail 0, but the next leaf group


def test_mixed_cluster_keeps_chip_speed_and_memory():
    graph = _graph("mixed-h100-a100")
    assert set(np.unique(graph.devices.speed).tolist()) == {1.0, 3.0}
    assert set(np.unique(graph.devices.memory_gb).tolist()) == {40.0, 80.0}
    h100, a100 = graph.devices_of_node(0)[0], graph.devices_of_node(16)[0]
    # Other leaf group: through the 1.5:1 spine, and the A100's slower NIC bounds the pair.
    assert graph.tier_between(h100, a100) == LinkTier.CROSS_RAIL
    assert graph.bandwidth_between(h100, a100) == pytest.approx(200 / 8 / 1.5)


@pytest.mark.parametrize("name", ["mixed-h100-a100", "h100-rail-2048", "sim-2x4"])
def test_slowest_link_equals_brute_force(name):
    graph = _graph(name)
    rng = np.random.default_rng(7)
    for _ in range(60):
        size = int(rng.integers(2, min(graph.num_devices, 24) + 1))
        ids = rng.choice(graph.num_devices, size=size, replace=False)
        if name == "h100-rail-2048" and rng.random() < 0.5:
            ids = rng.choice(64, size=min(size, 64), replace=False) * 8  # same-rail groups
        summary = slowest_link(graph, ids)
        assert (int(summary.tier), summary.bandwidth_gb_per_s) == _brute(graph, ids)


def test_slowest_link_of_one_device_is_none_and_of_an_island_is_nvlink():
    graph = _graph("sim-2x4")
    assert slowest_link(graph, [3]) is None
    assert slowest_link(graph, [0, 1, 2, 3]).tier == LinkTier.NVLINK


def test_pcie_and_nvlink_pair_islands():
    raw = {
        "name": "islands",
        "node_types": {"box": {"accelerator": "cuda", "num_devices": 4,
                               "chip": {"model": "a6000", "memory_gb": 48},
                               "intra_node": {"fabric": "nvlink", "bandwidth_gbps": 448,
                                              "pcie_bandwidth_gbps": 128, "islands": [[0, 1], [2, 3]]}},
                       "pcie": {"accelerator": "cuda", "num_devices": 2, "chip": {"model": "l4", "memory_gb": 24},
                                "intra_node": {"fabric": "pcie", "bandwidth_gbps": 256}}},
        "nodes": [{"type": "box", "count": 1}, {"type": "pcie", "count": 1}],
    }
    graph = ResourceGraph.from_descriptor(descriptor_from_dict(raw))
    assert [i.tolist() for i in graph.islands()] == [[0, 1], [2, 3], [4], [5]]
    assert graph.tier_between(0, 1) == LinkTier.NVLINK and graph.bandwidth_between(0, 1) == 56.0
    assert graph.tier_between(1, 2) == LinkTier.PCIE and graph.bandwidth_between(1, 2) == 16.0
    assert graph.tier_between(4, 5) == LinkTier.PCIE and graph.bandwidth_between(4, 5) == 32.0
    assert slowest_link(graph, [0, 1, 2]).tier == LinkTier.PCIE
    assert graph.rails() == {}  # no NICs declared: no rails


def test_subgraphs_keep_original_ids():
    graph = _graph("mixed-h100-a100")
    without = graph.without_nodes([0, 17])
    assert without.num_nodes == 30 and without.num_devices == 240
    assert 0 not in without.node_ids and without.device_ids[0] == 8
    assert without.tier_between(8, 255) == graph.tier_between(8, 255)
    with pytest.raises(KeyError):
        without.tier_between(0, 8)
    fewer = graph.without_devices([1, 2])
    assert fewer.num_nodes == 32 and fewer.devices_of_node(0).tolist() == [0, 3, 4, 5, 6, 7]
    assert slowest_link(fewer, [0, 3]) == slowest_link(graph, [0, 3])
    with pytest.raises(KeyError):
        graph.without_nodes([99])


def test_descriptor_subset_and_extra_nodes():
    descriptor = load_descriptor(CLUSTERS / "sim-2x4.yaml")
    graph = ResourceGraph.from_descriptor(descriptor, {1: "sim-a100-node", 2: "sim-a100-node"})
    assert graph.node_ids.tolist() == [1, 2] and graph.device_ids.tolist() == list(range(8))
    assert graph.nodes.names == ("node-1", "node-2")
    with pytest.raises(ValueError, match="present node types"):
        ResourceGraph.from_descriptor(descriptor, {0: "nope"})


def test_100k_devices_build_fast_and_small():
    import time

    descriptor = descriptor_from_dict({
        "name": "big", "node_types": {"n": {"accelerator": "cuda", "num_devices": 8,
                                            "chip": {"model": "h100", "memory_gb": 80},
                                            "intra_node": {"fabric": "nvswitch", "bandwidth_gbps": 3600}}},
        "nodes": [{"type": "n", "count": 12_500}], "network": {"nodes_per_leaf": 32, "leaves_per_pod": 16},
    })
    start = time.perf_counter()
    graph = ResourceGraph.from_descriptor(descriptor)
    elapsed = time.perf_counter() - start
    assert graph.num_devices == 100_000
    size = sum(getattr(graph.devices, f).nbytes for f in graph.devices.__dataclass_fields__)
    assert size < 16 * 2**20  # a few bytes per device, never n x n
    assert elapsed < 5.0  # generous: a shared CI box; the benchmark reports the real figure
