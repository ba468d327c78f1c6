"""The planner searches context parallelism where the engines run it, and says why it picked it."""

import numpy as np
import pytest
import yaml

from baige_ray.catalog import cluster_descriptor
from baige_ray.planner.cost import stage_times
from baige_ray.planner.evaluate import Layout, context_parallel_choices, row_grid
from baige_ray.planner.mapping import layout_links, rank_groups
from baige_ray.planner.model_spec import ModelSpec, load_model_spec
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.plan import plan
from baige_ray.planner.report import explain_text, plan_to_dict
from baige_ray.planner.search import Hardware
from baige_ray.runtime.auto_plan import layout_from_plan
from baige_ray.topology.descriptor import descriptor_from_dict, load_descriptor
from baige_ray.topology.graph import ResourceGraph


def _h100_nodes(count: int) -> ResourceGraph:
    descriptor = yaml.safe_load(cluster_descriptor("h100-rail-2048").read_text())
    descriptor["nodes"] = [{"type": "hgx-h100", "count": count}]
    return ResourceGraph.from_descriptor(descriptor_from_dict(descriptor))


def test_cp_degrees_split_the_sequence_and_the_batch_and_ulysses_the_heads():
    llama = load_model_spec("llama-3-8b", global_batch=4, seq_len=96)  # 32 heads, 8 KV heads
    # dp=8 ranks leave dp / cp replicas, which must split 4 sequences: not cp=1 (8 replicas)
    assert context_parallel_choices(llama, dp=8, pp=1, tp=1) == [
        (2, False), (2, True), (4, False), (4, True), (8, False), (8, True)]
    assert context_parallel_choices(llama, dp=8, pp=1, tp=8)[-1] == (8, False)  # 4 heads a TP rank: no Ulysses 8
    odd = load_model_spec("llama-3-8b", global_batch=4, seq_len=100)  # 2 x cp chunks: only cp=2
    assert context_parallel_choices(odd, dp=8, pp=1, tp=1) == [(2, False), (2, True)]
    assert context_parallel_choices(llama, dp=4, pp=2, tp=1) == [(1, False)]  # not with pipelining
    rows = row_grid(llama, dp=8, pp=1, zero_stages=(0, 1, 3), recomputes=(0,), max_micro_batch=8)
    assert set(rows.zero[rows.cp > 1]) == {0, 3}  # beside DDP or FSDP2 only, not DeepSpeed's ZeRO-1
    assert set(zip(rows.cp[rows.cp == 8], rows.micro_batch[rows.cp == 8])) == {(8, 1), (8, 2), (8, 4)}


def test_a_model_the_engines_cannot_split_gets_no_cp():
    gpt = ModelSpec(name="gpt", num_layers=4, hidden=256, ffn_hidden=1024, num_heads=4, seq_len=4096,
                    vocab_size=1000, global_batch=8)
    assert not gpt.context_parallel and context_parallel_choices(gpt, dp=8, pp=1, tp=1) == [(1, False)]


def test_a_mixture_of_experts_gets_cp_with_expert_groups_whose_ranks_are_cp_apart():
    moe = load_model_spec("mixtral-8x7b-v0.1", global_batch=8, seq_len=4096)
    assert moe.context_parallel and (8, False) in context_parallel_choices(moe, dp=8, pp=1, tp=1)
    rows = row_grid(moe, dp=8, pp=1, zero_stages=(0, 3), recomputes=(0,), max_micro_batch=1)
    assert set(rows.ep[rows.cp == 1]) == {1, 2, 4, 8} and set(rows.ep[rows.cp == 4]) == {1, 2}
    assert set(rows.ep[rows.cp == 8]) == {1}  # experts need ep replicas of cp ranks each
    # The engines' mesh (edp, ep, cp): CP groups are consecutive replicas, expert groups take one rank of each
    assert rank_groups("ep", 1, 8, 1, 2).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_groups("ep", 1, 8, 1, 2, 2).tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups("ep", 2, 4, 1, 2, 2).tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]  # TP ranks beside


def test_expert_groups_beside_cp_are_priced_on_the_links_they_cross():
    """DP8 over two 4-GPU nodes with CP4: a CP group is one node, so each expert pair spans the two nodes."""
    moe = load_model_spec("mixtral-8x7b-v0.1", global_batch=8, seq_len=4096)
    hardware = Hardware(ResourceGraph.from_descriptor(load_descriptor("sim-2x4")), PlanOptions())
    layout = Layout(tp=1, pp=1, dp=8, mapping="tp-dp-pp/node")
    links = layout_links(hardware.tables, hardware.positions(layout), tp=1, dp=8, pp=1, eps=(1, 2), cps=(4,))
    assert links["ep2"].tier < links["ep2/cp4"].tier  # neighbours on one node; one rank of each node
    times = stage_times(moe, PlanOptions().constants, stage_layers=[moe.num_layers], stage_peak=np.array([1e15]),
                        tp=1, pp=1, links=links, ep=np.array([2, 2]), micro_batch=np.array([1, 4]),
                        recompute=np.array([0, 0]), cp=np.array([1, 4]))
    assert times.ep[0, 0] > 0 and times.ep[1, 0] > 0


def test_llama_3_8b_at_128k_on_eight_h100s_splits_every_sequence_eight_ways_and_says_why():
    placement = plan(load_model_spec("llama-3-8b", global_batch=8, seq_len=131072), _h100_nodes(1))
    assert (placement.dp, placement.cp, placement.tp, placement.pp) == (8, 8, 1, 1)
    assert "without CP needs" in placement.context_parallel_reason
    text = explain_text(placement)
    assert "cp=8" in text and "CP key-value exchange" in text and "context    cp=8" in text
    assert plan_to_dict(placement)["cp"] == 8
    layout = layout_from_plan(placement)
    assert (layout.dp, layout.cp, layout.data_parallel) == (1, 8, "fsdp2")


def test_llama_3_405b_at_128k_uses_all_16k_gpus_through_cp_where_the_batch_has_128_sequences():
    graph = ResourceGraph.from_descriptor(load_descriptor("h100-rail-2048"))
    placement = plan(load_model_spec("llama-3.1-405b", global_batch=128, seq_len=131072), graph)
    assert placement.num_ranks == 16384 and placement.cp > 1 and placement.dp // placement.cp <= 128
    assert placement.memory_per_device_gb < 72.0 and "without CP needs" in placement.context_parallel_reason


def test_short_sequences_keep_plain_data_parallelism():
    graph = ResourceGraph.from_descriptor(load_descriptor("sim-2x4"))
    placement = plan(load_model_spec("qwen2.5-0.5b", global_batch=64, seq_len=2048), graph)
    assert placement.cp == 1 and placement.context_parallel_reason == ""
    assert any(alt.cp > 1 for alt in placement.alternatives)  # priced, and slower: its exchange costs time
    cp_alternative = next(alt for alt in placement.alternatives if alt.cp > 1)
    assert "CP key-value exchange" in cp_alternative.why_lost
    assert cp_alternative.step_time_s > placement.step_time_s
    assert np.isfinite(placement.step_time_s)


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_the_exchange_time_is_the_bytes_on_the_cp_link(kind):
    from baige_ray.planner.context_parallel import context_parallel_bytes_per_layer, context_parallel_seconds
    from baige_ray.planner.links import GroupLink

    llama = load_model_spec("llama-3-8b", global_batch=8, seq_len=32768)
    link = GroupLink(tier=0, bandwidth=100e9, latency=0.0)
    seconds = context_parallel_seconds(llama, cp=4, kind=kind, micro_batch=1, tp=1, link=link)
    sent = context_parallel_bytes_per_layer(llama, cp=4, kind=kind, micro_batch=1)
    assert float(seconds) == pytest.approx(sent / 100e9)


def test_ring_gathers_hide_behind_the_attention_to_the_ranks_own_keys_and_the_rest_adds_whole():
    from baige_ray.planner.context_parallel import context_parallel_seconds, layer_seconds
    from baige_ray.planner.links import GroupLink

    llama = load_model_spec("llama-3-8b", global_batch=8, seq_len=32768)
    links = {"cp4": GroupLink(tier=0, bandwidth=100e9, latency=0.0)}
    ring, ulysses = (layer_seconds(llama, cp=np.array([4]), ulysses=np.array([kind]), micro_batch=np.array([1]), tp=1,
                                   links=links) for kind in (False, True))
    whole = context_parallel_seconds(llama, cp=4, kind="ring", micro_batch=1, tp=1, link=links["cp4"])
    gather = float(ring.gather[0, 0])
    assert float(2 * ring.gather + ring.waiting) == pytest.approx(float(whole))
    assert float(ring.exposed(np.array([[0.0]]))) == pytest.approx(float(whole))  # nothing to hide behind
    assert float(ring.exposed(np.array([[gather]]))) == pytest.approx(float(ring.waiting))  # both gathers hidden
    assert float(ring.exposed(np.array([[gather / 2]]))) == pytest.approx(gather / 2 + float(ring.waiting))
    assert float(ulysses.waiting) > 0  # nothing hides Ulysses' exchanges
    assert float(ulysses.exposed(np.array([[1.0]]))) == pytest.approx(float(ulysses.waiting))
