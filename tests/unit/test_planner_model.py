"""ModelSpec, memory and collective formulas against the numbers in their papers."""

import numpy as np
import pytest

from baige_ray.models.gpt import GPTConfig
from baige_ray.planner.cost import all_reduce, reduce_scatter
from baige_ray.planner.links import GroupLink
from baige_ray.planner.memory import activation_bytes_per_layer, model_state_bytes
from baige_ray.planner.model_spec import ModelSpec, load_model_spec

from ..conftest import REPO_ROOT

GPT3 = REPO_ROOT / "examples" / "models" / "gpt-175b.yaml"


def test_gpt3_has_175b_parameters_and_megatron_flops():
    model = load_model_spec(GPT3)
    assert model.num_params == pytest.approx(175e9, rel=0.01)
    # Narayanan et al. 2021 eq. 3: 72 B s l h^2 (1 + s/6h + V/(12 l h)) per step without recomputation.
    b, s, l, h, v = model.global_batch, model.seq_len, model.num_layers, model.hidden, model.vocab_size
    expected = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert model.model_flops_per_step() == pytest.approx(expected, rel=1e-3)


def test_spec_from_reference_gpt_config_and_validation():
    spec = ModelSpec.from_gpt_config(GPTConfig(num_layers=2, hidden=64, num_heads=4), global_batch=8)
    assert (spec.num_layers, spec.ffn_hidden, spec.kv_heads) == (2, 256, 4)
    with pytest.raises(ValueError, match=r"ModelSpec.num_kv_heads=3 is invalid"):
        ModelSpec(num_layers=2, hidden=64, ffn_hidden=256, num_heads=4, num_kv_heads=3, seq_len=8, vocab_size=16,
                  global_batch=4)
    with pytest.raises(ValueError, match=r"ModelSpec.dtype_bytes=3 is invalid"):
        ModelSpec(num_layers=2, hidden=64, ffn_hidden=256, num_heads=4, seq_len=8, vocab_size=16, global_batch=4,
                  dtype_bytes=3)


def test_activation_memory_matches_korthikanti():
    model = load_model_spec(GPT3)
    s, h, a, t = model.seq_len, model.hidden, model.num_heads, 8
    none, selective, full = (activation_bytes_per_layer(model, 1, np.array(rc), t) for rc in (0, 1, 2))
    # Eq. 5 (34sbh/t with sequence parallelism) but for the column-parallel inputs torch saves whole (4sbh)
    assert none == pytest.approx(s * h * (4 + 30 / t + 5 * a * s / (h * t)))
    assert selective == pytest.approx(s * h * (4 + 30 / t))  # sec. 5
    assert full == pytest.approx(2 * s * h / t)
    # Without sequence parallelism: eq. 4, the residual stream's 6sbh whole too
    plain_tp = activation_bytes_per_layer(model, 1, np.array(0), t, sequence_parallel=False)
    assert plain_tp == pytest.approx(s * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert plain_tp / none == pytest.approx((10 + 24 / t + 5 * a * s / (h * t)) / (4 + 30 / t + 5 * a * s / (h * t)))
    one_rank = activation_bytes_per_layer(model, 1, np.array(0), 1)
    assert one_rank == pytest.approx(s * h * (34 + 5 * a * s / h))  # eq. 1, whatever sequence_parallel says


def test_zero_stages_shard_16_bytes_per_parameter():
    model = ModelSpec(num_layers=1, hidden=64, ffn_hidden=256, num_heads=4, seq_len=8, vocab_size=16,
                      global_batch=8)
    layers = np.array([1])
    psi = model.num_params
    bytes_per_stage = model_state_bytes(model, layers, tp=1, dp=4, ep=np.ones(4), zero=np.arange(4))[:, 0]
    # ZeRO-3 gathers two layers, and the weights outside the layers with their gradient (+ its fp32 copy)
    gathered = 2 * 2 * model.dense_layer_params + (2 * 2 + 4) * (model.embedding_params + model.output_params)
    expected = [16 * psi, 4 * psi + 12 * psi / 4, 2 * psi + 14 * psi / 4, 16 * psi / 4 + gathered]
    assert bytes_per_stage == pytest.approx(expected)


def test_collectives_follow_alpha_beta():
    link = GroupLink(tier=2, bandwidth=1e9, latency=1e-5)
    assert float(all_reduce(8, 1e9, link)) == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8)
    assert float(reduce_scatter(8, 1e9, link)) == pytest.approx(7 * 1e-5 + 7 / 8)
    assert float(all_reduce(1, 1e9, link)) == 0.0
    # Tiny messages on many ranks: the tree's log2(n) latency wins over the ring's n.
    assert float(all_reduce(1024, 8, link)) == pytest.approx(2 * 10 * 1e-5 + 16 / 1e9)
