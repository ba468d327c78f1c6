"""The pruned search against brute force, and infeasible requests."""

import pytest

from baige_ray.api.errors import InfeasiblePlanError
from baige_ray.planner.bruteforce import brute_force
from baige_ray.planner.evaluate import row_grid
from baige_ray.planner.model_spec import ModelSpec, load_model_spec
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.plan import plan
from baige_ray.planner.report import explain_text
from baige_ray.planner.search import Hardware, search
from baige_ray.topology.descriptor import load_descriptor
from baige_ray.topology.graph import ResourceGraph

from ..conftest import REPO_ROOT, SIM_2X4


def _sim() -> ResourceGraph:
    return ResourceGraph.from_descriptor(load_descriptor(SIM_2X4))


@pytest.mark.parametrize("model", [
    ModelSpec(name="dense", num_layers=8, hidden=2048, ffn_hidden=8192, num_heads=16, seq_len=1024,
              vocab_size=32000, global_batch=16),
    ModelSpec(name="moe", num_layers=4, hidden=1024, ffn_hidden=4096, num_heads=8, num_kv_heads=2, seq_len=512,
              vocab_size=8000, global_batch=8, num_experts=4, top_k=2),
])
def test_pick_equals_brute_force(model):
    options = PlanOptions(recompute=("none", "full"), max_micro_batch=8)
    graph = _sim()
    exact = brute_force(model, graph, options)
    pick = search(model, options, Hardware(graph, options)).ranked[0]
    assert pick.step_s == pytest.approx(exact.step_s, rel=1e-9)
    assert pick.order_key[1:] == exact.order_key[1:]


def test_alternatives_are_distinct_slower_and_explained():
    chosen = plan(load_model_spec(REPO_ROOT / "examples" / "models" / "gpt-small.yaml"), _sim())
    degrees = {(a.tp, a.pp, a.dp, a.ep) for a in chosen.alternatives}
    assert len(degrees) == len(chosen.alternatives) == 5
    assert (chosen.tp, chosen.pp, chosen.dp, chosen.ep) not in degrees
    assert all(a.step_time_s >= chosen.step_time_s and "step time" in a.why_lost for a in chosen.alternatives)
    text = explain_text(chosen)
    assert "why they lost" in text and "MFU" in text


def test_model_too_large_reports_memory_needed_vs_available():
    with pytest.raises(InfeasiblePlanError) as error:
        plan(load_model_spec(REPO_ROOT / "examples" / "models" / "gpt-175b.yaml"), _sim())
    assert error.value.needed_gb > error.value.available_gb > 0
    assert "GB per device" in str(error.value) and "tp=" in error.value.layout


def test_too_few_devices_is_infeasible():
    graph = _sim()
    model = ModelSpec(num_layers=2, hidden=64, ffn_hidden=256, num_heads=4, seq_len=8, vocab_size=16, global_batch=4)
    with pytest.raises(InfeasiblePlanError):
        plan(model, graph.without_devices(graph.device_ids))


def test_max_pp_keeps_every_candidate_within_that_many_stages():
    model = load_model_spec(REPO_ROOT / "examples" / "models" / "gpt-small.yaml")
    free = plan(model, _sim())
    assert max(a.pp for a in (free, *free.alternatives)) > 1  # the search uses pipelines when allowed
    single = plan(model, _sim(), PlanOptions(max_pp=1))
    assert {a.pp for a in (single, *single.alternatives)} == {1}
    with pytest.raises(ValueError, match="PlanOptions.max_pp"):
        PlanOptions(max_pp=0)


def test_expert_parallelism_keeps_to_the_zero_stages_allowed_beside_it():
    """baige-ray's engines run EP beside ZeRO-1/2 (DeepSpeed's expert groups) but not ZeRO-3."""
    model = ModelSpec(name="moe", num_layers=4, hidden=1024, ffn_hidden=4096, num_heads=8, num_kv_heads=2,
                      seq_len=512, vocab_size=8000, global_batch=8, num_experts=4, top_k=2)
    options = PlanOptions(recompute=("none",), max_micro_batch=8, expert_parallel_zero_stages=(0, 1, 2))
    graph = _sim()
    ranked = search(model, options, Hardware(graph, options)).ranked
    assert ranked[0].step_s == pytest.approx(brute_force(model, graph, options).step_s, rel=1e-9)
    assert not [c for c in ranked if c.ep > 1 and c.zero == 3]
    rows = row_grid(model, dp=4, pp=1, zero_stages=(0, 1, 2, 3), recomputes=(0,), max_micro_batch=8,
                    expert_parallel_zero_stages=options.expert_parallel_zero_stages)
    pairs = set(zip(rows.ep.tolist(), rows.zero.tolist()))
    assert {(2, 1), (2, 2), (4, 1), (4, 2), (1, 3)} <= pairs and not {(2, 3), (4, 3)} & pairs
    with pytest.raises(ValueError, match="PlanOptions.expert_parallel_zero_stages"):
        PlanOptions(expert_parallel_zero_stages=(4,))
