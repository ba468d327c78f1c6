import struct
from pathlib import Path

import numpy as np
import pytest

from baige_ray.cli import main
from baige_ray.ops.events import EventLog
from baige_ray.ops.plots import (UNUSED, device_series, incidents, panel_dims, placement_grid, plot_placement,
                                 plot_timeline, plot_topology, rank_group_index, sample_nodes)
from baige_ray.planner.model_spec import load_model_spec
from baige_ray.planner.plan import plan
from baige_ray.topology.descriptor import load_descriptor
from baige_ray.topology.graph import ResourceGraph

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"  # written to the end
    return struct.unpack(">II", data[16:24])


def _assert_plausible_png(path: Path) -> None:
    width, height = _png_size(path)
    assert 200 <= width <= 6000 and 150 <= height <= 6000
    assert path.stat().st_size > 5_000  # more than a blank canvas


def _graph(name: str) -> ResourceGraph:
    return ResourceGraph.from_descriptor(load_descriptor(REPO / "clusters" / name))


def _plan(model: str, cluster: str):
    graph = _graph(cluster)
    return plan(load_model_spec(REPO / "examples" / "models" / model), graph), graph


def _events(tmp_path: Path) -> Path:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.record("start", "8 workers up", num_workers=8)
        log.record("failure", "actor died", rank=5, node_id="n1")
        log.record("resize", "shrink after failure", train_devices=6, infer_devices=0)
        log.record("lend", "inference queue rising", train_devices=4, infer_devices=2)
        log.record("reclaim", "queue drained", train_devices=8, infer_devices=0)
        log.record("finished", "300 steps")
    return path


def test_topology_png(tmp_path):
    _assert_plausible_png(plot_topology(_graph("dgx-a100-superpod.yaml"), tmp_path / "topo.png"))


def test_placement_png_of_a_sampled_large_cluster(tmp_path):
    chosen, graph = _plan("gpt-175b.yaml", "h100-rail-2048.yaml")
    _assert_plausible_png(plot_placement(chosen, graph, tmp_path / "place.png", max_nodes=8))


def test_timeline_png(tmp_path):
    from baige_ray.ops.events import read_events

    _assert_plausible_png(plot_timeline(read_events(_events(tmp_path)), tmp_path / "timeline.png"))


def test_cli_writes_each_kind_of_plot(tmp_path, capsys):
    outputs = {
        "topology": ["topology", "--cluster", str(REPO / "clusters" / "sim-2x4.yaml")],
        "placement": ["placement", str(REPO / "examples" / "models" / "gpt-small.yaml"),
                      "--cluster", str(REPO / "clusters" / "sim-2x4.yaml")],
        "timeline": ["timeline", str(_events(tmp_path))],
    }
    for kind, args in outputs.items():
        out = tmp_path / "plots" / f"{kind}.png"
        assert main(["plot", *args, "--out", str(out)]) == 0
        assert capsys.readouterr().out.strip() == str(out)
        _assert_plausible_png(out)


def test_bad_max_nodes_is_reported(tmp_path, capsys):
    code = main(["plot", "placement", str(REPO / "examples" / "models" / "gpt-small.yaml"),
                 "--cluster", str(REPO / "clusters" / "sim-2x4.yaml"), "--max-nodes", "0",
                 "--out", str(tmp_path / "x.png")])
    assert code == 2 and "--max-nodes=0" in capsys.readouterr().err


def test_group_index_of_every_rank_matches_the_plans_groups():
    chosen, _ = _plan("gpt-175b.yaml", "h100-rail-2048.yaml")
    for dim in ("tp", "dp"):
        index = rank_group_index(chosen, dim)
        for group_number, ranks in enumerate(chosen.groups(dim)[:50]):
            assert (index[ranks] == group_number).all()
    stages = rank_group_index(chosen, "pp")
    assert [int(stages[r]) for r in (0, chosen.tp * chosen.dp - 1, chosen.tp * chosen.dp)] == [0, 0, 1]
    assert panel_dims(chosen) == ["tp", "dp", "pp"]


def test_placement_grid_puts_each_rank_on_its_device():
    chosen, graph = _plan("gpt-small.yaml", "sim-2x4.yaml")
    nodes = sample_nodes(chosen, graph, max_nodes=16)
    assert nodes == [0, 1]
    grid = placement_grid(chosen, graph, nodes)
    for (row, col), rank in np.ndenumerate(grid):
        device = graph.devices_of_node(nodes[row])[col]
        assert rank == UNUSED or chosen.rank_to_device[rank] == device
    assert sorted(grid[grid != UNUSED].tolist()) == list(range(chosen.num_ranks))


def test_sample_of_a_large_cluster_spans_pipeline_stages_and_data_parallel_peers():
    chosen, graph = _plan("gpt-175b.yaml", "h100-rail-2048.yaml")
    nodes = sample_nodes(chosen, graph, max_nodes=8)
    assert len(nodes) == 8 and nodes == sorted(nodes)
    stages_seen = {int(rank_group_index(chosen, "pp")[r]) for r in placement_grid(chosen, graph, nodes).ravel()
                   if r != UNUSED}
    assert len(stages_seen) >= 4 and 0 in stages_seen


def test_device_series_steps_through_counts_and_holds_the_last(tmp_path):
    from baige_ray.ops.events import read_events

    events = read_events(_events(tmp_path))
    series = device_series(events)
    assert series.train.tolist() == [8, 6, 4, 8, 0, 0]  # the finished job holds nothing
    assert series.infer.tolist() == [0, 0, 2, 0, 0, 0]
    assert series.times[0] == 0.0 and series.times[-1] == pytest.approx(events[-1]["time"] - events[0]["time"])
    assert np.all(np.diff(series.times) >= 0)


def test_device_series_of_a_log_without_counts_is_empty():
    series = device_series([{"time": 5.0, "kind": "plan", "reason": "x"}])
    assert len(series.times) == 0 and series.start == 5.0
    assert len(device_series([]).train) == 0


def test_incidents_mark_failures_with_their_rank():
    events = [{"time": 10.0, "kind": "start"}, {"time": 12.5, "kind": "failure", "rank": 3},
              {"time": 13.0, "kind": "eviction"}, {"time": 20.0, "kind": "lend"}]
    assert incidents(events, start=10.0) == [(2.5, "failure", "rank 3"), (3.0, "eviction", "")]
