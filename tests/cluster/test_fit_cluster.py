"""DDP over the simulated 2-node x 4-GPU cluster: placement and the mathematics of a step."""

from collections import Counter

import pytest

from baige_ray import GPTConfig, RunConfig, ScalingConfig, TrainConfig, fit
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.corpus import CorpusConfig

from ..helpers import reference_losses

MODEL = GPTConfig(seq_len=32, num_layers=2, num_heads=2, hidden=32)
CORPUS = CorpusConfig(max_bytes=1 << 20)
TRAIN = TrainConfig(num_steps=3, global_batch_size=16, warmup_steps=1, seed=5)


@pytest.fixture(scope="module")
def result(sim_cluster, tmp_path_factory):
    run = RunConfig(name="sim8", storage_path=tmp_path_factory.mktemp("runs"), show_progress=False)
    return fit(MODEL, train=TRAIN, scaling=ScalingConfig(num_workers=8), run=run, data=CORPUS)


def test_eight_workers_fill_both_nodes_and_ranks_follow_locality(sim_cluster, result):
    if not sim_cluster.simulated:
        pytest.skip("placement is only known for the simulated descriptor")
    nodes = [worker.node_id for worker in result.workers]
    assert sorted(Counter(nodes).values()) == [4, 4]
    # ranks 0-3 share one node, 4-7 the other, each in device order
    assert len(set(nodes[:4])) == 1 and len(set(nodes[4:])) == 1
    assert [w.device_index for w in result.workers[:4]] == sorted(w.device_index for w in result.workers[:4])
    assert all(worker.simulated for worker in result.workers)


def test_eight_way_ddp_matches_one_process(result):
    expected = reference_losses(TrainJob(model=MODEL, train=TRAIN, data=CORPUS))
    assert result.losses == pytest.approx(expected, rel=1e-5)


def test_auto_layout_runs_the_planners_choice_where_it_placed_it(sim_cluster, tmp_path):
    from baige_ray.runtime.auto_plan import first_devices, layout_from_plan, live_graph, plan_job

    job = TrainJob(model=MODEL, train=TRAIN, data=CORPUS)
    chosen = plan_job(job, first_devices(live_graph(), 8))
    run = RunConfig(name="auto", storage_path=tmp_path, show_progress=False)
    result = fit(MODEL, train=TRAIN, scaling=ScalingConfig(num_workers=8), run=run, data=CORPUS, layout="auto")
    assert result.layout == layout_from_plan(chosen).describe()
    assert result.num_workers == chosen.num_ranks
    assert result.losses == pytest.approx(reference_losses(job), rel=1e-5)


def test_auto_layout_shards_the_experts_of_an_moe_model_where_the_cost_model_prefers_it(sim_cluster, tmp_path):
    """Wide experts and a small batch: sharding the experts two ways halves their gradient all-reduce
    for less than its all-to-all costs, on the simulated A100s' links."""
    from baige_ray.models.moe import MoEConfig
    from baige_ray.runtime.auto_plan import first_devices, layout_from_plan, live_graph, plan_job

    model = GPTConfig(seq_len=32, num_layers=2, num_heads=2, hidden=64,
                      moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden=2048))
    train = TrainConfig(num_steps=3, global_batch_size=32, warmup_steps=1, seed=5)
    job = TrainJob(model=model, train=train, data=CORPUS)
    chosen = plan_job(job, first_devices(live_graph(), 4))
    assert chosen.ep > 1
    run = RunConfig(name="auto-moe", storage_path=tmp_path, show_progress=False)
    result = fit(model, train=train, scaling=ScalingConfig(num_workers=4), run=run, data=CORPUS, layout="auto")
    assert result.layout == layout_from_plan(chosen).describe() == "DP4xEP2 (ddp)"
    assert result.losses == pytest.approx(reference_losses(job), rel=1e-4)
