"""Direct ingress and the vLLM engine core's place: what serve() takes and refuses, before anything starts."""

from __future__ import annotations

import pytest

from baige_ray.serving.app import ServeOptions
from baige_ray.serving.direct_ingress import DIRECT_INGRESS_ENV, DRAINING_ENV, _reachable, with_direct_ingress
from baige_ray.serving.disaggregation import DisaggregationOptions
from baige_ray.serving.engine import EngineLimits
from baige_ray.serving.vllm_engine import VLLMSettings, engine_arguments


def test_direct_ingress_is_turned_on_in_the_replicas_runtime_environment_beside_the_callers_own():
    mine = {"num_cpus": 1, "runtime_env": {"env_vars": {"MY_FLAG": "1"}, "pip": ["x"]}}
    options = with_direct_ingress(mine)
    assert options["runtime_env"] == {"env_vars": {"MY_FLAG": "1", DIRECT_INGRESS_ENV: "1", DRAINING_ENV: "1"},
                                      "pip": ["x"]}
    assert options["num_cpus"] == 1 and mine["runtime_env"]["env_vars"] == {"MY_FLAG": "1"}  # the caller's untouched
    assert with_direct_ingress({})["runtime_env"] == {"env_vars": {DIRECT_INGRESS_ENV: "1", DRAINING_ENV: "1"}}
    mine = {"runtime_env": {"env_vars": {DRAINING_ENV: "30"}}}  # a load balancer in front: the caller's period
    assert with_direct_ingress(mine)["runtime_env"]["env_vars"][DRAINING_ENV] == "30"


def test_a_replica_bound_to_the_loopback_is_reached_there_and_otherwise_at_its_nodes_address():
    assert _reachable("127.0.0.1", "10.0.0.7") == "127.0.0.1"
    assert _reachable("0.0.0.0", "10.0.0.7") == "10.0.0.7"


def test_direct_ingress_is_refused_where_a_router_picks_the_replica():
    assert ServeOptions(direct_ingress=True).direct_ingress
    with pytest.raises(ValueError, match=r"ServeOptions.direct_ingress is set with routing='prefix'"):
        ServeOptions(direct_ingress=True, routing="prefix")
    with pytest.raises(ValueError, match=r"ServeOptions.direct_ingress is set with routing='default' and disagg"):
        ServeOptions(direct_ingress=True, disaggregation=DisaggregationOptions())
    with pytest.raises(ValueError, match=r"ServeOptions.direct_ingress='yes' is invalid"):
        ServeOptions(direct_ingress="yes")


def test_the_vllm_engine_core_runs_beside_the_replica_by_default_and_in_it_when_asked():
    assert ServeOptions().vllm_engine_core == "process"
    with pytest.raises(ValueError, match=r"ServeOptions.vllm_engine_core='thread' is invalid: expected one of"):
        ServeOptions(vllm_engine_core="thread")
    with pytest.raises(ValueError, match=r"ServeOptions.vllm_engine_core='replica' is set with engine='builtin'"):
        ServeOptions(vllm_engine_core="replica")
    with pytest.raises(ValueError, match=r"VLLMSettings.engine_core='thread' is invalid"):
        VLLMSettings(model_dir="/models/llama", max_context=64, engine_core="thread")
    # Either way weights reach vLLM's worker by method name (no function pickled across the process boundary).
    arguments = engine_arguments(VLLMSettings(model_dir="/models/llama", max_context=64), EngineLimits(),
                                 load_format="dummy")
    assert arguments["worker_extension_cls"] == "baige_ray.serving.vllm_worker.WeightLoading"


def test_weights_for_the_engine_cores_process_keep_a_tied_head_and_load_without_unpickling():
    """A model's own state dict ties its head to its embedding (one tensor under two names), which safetensors
    refuses to write as it is; the bytes hold both names, each with the embedding's values."""
    import torch
    from safetensors.torch import load

    from baige_ray.serving.vllm_worker import weights_blob

    embedding = torch.randn(8, 4)
    fused = torch.randn(6, 4)
    weights = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding,
               "q.weight": fused[:3], "k.weight": fused[3:].t()}  # views of one tensor, one of them not contiguous
    loaded = load(weights_blob(weights))
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
