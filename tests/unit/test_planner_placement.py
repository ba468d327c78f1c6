"""Rank mapping on real topologies, uneven stages on mixed chips, replan, bundles, the plan CLI."""

import json

import numpy as np
import pytest

from baige_ray.cli import main
from baige_ray.planner.materialize import bundle_layout
from baige_ray.planner.model_spec import ModelSpec, load_model_spec
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.plan import plan
from baige_ray.planner.replan import replan
from baige_ray.topology.descriptor import load_descriptor
from baige_ray.topology.graph import LinkTier, ResourceGraph
from baige_ray.topology.groups import slowest_link

from ..conftest import REPO_ROOT, SIM_2X4

CLUSTERS = REPO_ROOT / "clusters"
GPT3 = REPO_ROOT / "examples" / "models" / "gpt-175b.yaml"


def _graph(name: str) -> ResourceGraph:
    return ResourceGraph.from_descriptor(load_descriptor(CLUSTERS / f"{name}.yaml"))


@pytest.fixture(scope="module")
def dgx_plan():
    graph = _graph("dgx-a100-superpod")
    graph = graph.without_nodes(graph.node_ids[16:])  # one scalable unit: 16 nodes on one leaf per rail
    model = ModelSpec(name="gpt-76b", num_layers=60, hidden=10240, ffn_hidden=40960, num_heads=80, seq_len=2048,
                      vocab_size=51200, global_batch=1024)
    # Megatron-style ZeRO-0/1, so weights and gradients must be split by TP and PP to fit 80 GB.
    return graph, plan(model, graph, PlanOptions(zero_stages=(0, 1)))


def test_dgx_tp_inside_nodes_dp_and_pp_on_one_rail(dgx_plan):
    graph, chosen = dgx_plan
    assert chosen.tp > 1 and chosen.pp > 1 and chosen.dp > 1
    for group in chosen.device_groups("tp"):
        assert len(set(graph.devices.node[graph.positions(group)].tolist())) == 1
        assert slowest_link(graph, group).tier == LinkTier.NVLINK
    for dim in ("dp", "pp"):
        for group in chosen.device_groups(dim):
            position = graph.positions(group)
            nodes, rails = graph.devices.node[position], graph.devices.rail[position]
            # Peers on other nodes share one rail; peers on the same node talk over NVLink.
            assert len(set(rails.tolist())) == 1 or len(set(nodes.tolist())) == 1
            assert slowest_link(graph, group).tier in (LinkTier.NVLINK, LinkTier.SAME_RAIL)
    dp_group = chosen.device_groups("dp")[0]
    assert len(set(graph.devices.node[graph.positions(dp_group)].tolist())) == chosen.dp  # DP crosses nodes
    assert chosen.links["dp"].tier == LinkTier.SAME_RAIL and chosen.links["tp"].tier == LinkTier.NVLINK
    assert len(set(chosen.rank_to_device.tolist())) == chosen.num_ranks


def test_mixed_chips_get_uneven_balanced_stages():
    graph = _graph("mixed-h100-a100")
    graph = graph.without_nodes([n for n in graph.node_ids if n not in (0, 1, 16, 17)])
    model = ModelSpec(name="gpt-52b", num_layers=64, hidden=8192, ffn_hidden=32768, num_heads=64, seq_len=2048,
                      vocab_size=51200, global_batch=64)
    chosen = plan(model, graph)
    assert len(set(chosen.stage_chips)) == 2 and len(set(chosen.stage_layers)) > 1
    fast = [n for n, chip in zip(chosen.stage_layers, chosen.stage_chips) if chip.startswith("h100")]
    slow = [n for n, chip in zip(chosen.stage_layers, chosen.stage_chips) if chip.startswith("a100")]
    assert min(fast) > 2 * max(slow)
    times = np.array(chosen.stage_time_s)
    assert (times.max() - times.min()) / times.max() < 0.10


def test_replan_after_losing_a_device_moves_only_its_group():
    graph = _graph("dgx-a100-superpod")
    graph = graph.without_nodes(graph.node_ids[9:])
    model = ModelSpec(name="gpt-7b", num_layers=32, hidden=4096, ffn_hidden=16384, num_heads=32, seq_len=2048,
                      vocab_size=32000, global_batch=256)
    before = plan(model, graph.without_nodes([8]))  # node 8 is the warm spare
    lost = int(before.rank_to_device[5])
    after = replan(before, graph.without_devices([lost]))
    assert after.repaired and not after.reshard
    moved = np.flatnonzero(after.plan.rank_to_device != before.rank_to_device)
    assert len(moved) == before.tp and 5 in moved
    assert after.ranks_in_place == before.num_ranks - before.tp
    assert set(after.state_sources) == set(moved.tolist())
    assert lost not in after.plan.rank_to_device


def test_bundles_group_ranks_by_node():
    chosen = plan(load_model_spec(REPO_ROOT / "examples" / "models" / "gpt-small.yaml"),
                  ResourceGraph.from_descriptor(load_descriptor(SIM_2X4)))
    layout = bundle_layout(chosen)
    assert [g.node_id for g in layout.groups] == [0, 1]
    assert all(len(g.bundles) == 4 and g.bundles[0]["GPU"] == 1.0 for g in layout.groups)
    assert "baige_node_1" in layout.groups[1].bundles[0]
    for rank in range(chosen.num_ranks):
        group, bundle = layout.rank_bundle[rank]
        assert layout.groups[group].ranks[bundle] == rank
        assert layout.groups[group].node_id == chosen.rank_to_node[rank]


def test_plan_cli_prints_text_and_json(capsys):
    model = str(REPO_ROOT / "examples" / "models" / "gpt-small.yaml")
    assert main(["plan", model, "--cluster", str(SIM_2X4)]) == 0
    assert "alternatives" in capsys.readouterr().out
    assert main(["plan", model, "--cluster", str(SIM_2X4), "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["num_ranks"] == len(data["rank_to_device"]) == 8
    assert main(["plan", str(GPT3), "--cluster", str(SIM_2X4)]) == 2
    assert "GB per device" in capsys.readouterr().err
