"""The mixture-of-experts layer on one process: routing, the balance loss, gradients, and bad configs."""

import pytest
import torch

from baige_ray.api.configs import TrainConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.aux_loss import auxiliary_losses
from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.moe import MoEConfig, MoELayer, Routing, sequence_balance_loss
from baige_ray.models.plugin import plugin_for
from baige_ray.parallel.layout import ParallelLayout, parse_layout

MOE = MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, aux_loss_coef=0.05)
TINY_MOE_GPT = GPTConfig(seq_len=16, hidden=32, num_layers=2, moe=MOE)


def layer(config: MoEConfig = MOE) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(16, 32, config, num_layers=2)


def test_each_token_gets_its_top_k_experts_weighted_by_renormalized_router_probabilities():
    moe = layer(MoEConfig(num_experts=4, top_k=2))
    x = torch.randn(2, 5, 16)
    tokens = x.reshape(-1, 16)
    routing = moe.router(tokens)
    expected = torch.zeros_like(tokens)
    for t in range(len(tokens)):
        for slot in range(2):
            e = int(routing.experts[t, slot])
            hidden = torch.nn.functional.gelu(tokens[t] @ moe.experts.up[e]) @ moe.experts.down[e]
            expected[t] += routing.weights[t, slot] * hidden
    with torch.no_grad():
        torch.testing.assert_close(moe(x).reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(len(tokens)))
    counts, _ = moe.traffic.take()
    assert counts.sum() == len(tokens) * 2  # no token dropped


def test_balance_loss_is_the_coefficient_for_a_uniform_router_and_more_when_one_expert_takes_all():
    batch, seq, experts, k = 2, 4, 4, 2
    uniform = Routing(experts=torch.tensor([[0, 1], [2, 3]] * (batch * seq // 2)),
                      weights=torch.full((batch * seq, k), 0.5), probabilities=torch.full((batch * seq, experts), 0.25))
    assert float(sequence_balance_loss(uniform, batch, experts, coef=0.1)) == pytest.approx(0.1)
    skewed_probabilities = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(batch * seq, 1)
    skewed = Routing(experts=torch.tensor([[0, 1]] * (batch * seq)), weights=torch.full((batch * seq, k), 0.5),
                     probabilities=skewed_probabilities)
    assert float(sequence_balance_loss(skewed, batch, experts, coef=0.1)) == pytest.approx(0.1 * (2 * 0.7 + 2 * 0.1))


def test_balance_loss_decomposes_over_a_split_of_the_batch():
    """Mean over sequences: two halves averaged equal the whole, so data-parallel replicas optimize it exactly."""
    moe = layer()
    tokens = torch.randn(4 * 6, 16)
    routing = moe.router(tokens)
    whole = sequence_balance_loss(routing, 4, 4, coef=0.05)
    halves = [Routing(experts=routing.experts[i * 12:(i + 1) * 12], weights=routing.weights[i * 12:(i + 1) * 12],
                      probabilities=routing.probabilities[i * 12:(i + 1) * 12]) for i in range(2)]
    torch.testing.assert_close(whole, sum(sequence_balance_loss(h, 2, 4, coef=0.05) for h in halves) / 2)


def test_the_balance_loss_reaches_the_router_with_the_engines_weight():
    model = GPT(TINY_MOE_GPT)
    tokens = torch.randint(0, 256, (2, 16))
    gate = model.blocks[0].mlp.router.gate.weight
    grads = []
    for weight in (1.0, 0.25):
        model.zero_grad()
        with auxiliary_losses(weight) as aux:
            model(tokens)[..., 0].sum().mul(0).backward()  # only the auxiliary loss has a gradient
        grads.append(gate.grad.clone())
    assert aux.total > 0
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0] * 0.25)


def test_without_gradients_no_auxiliary_loss_is_computed():
    model = GPT(TINY_MOE_GPT)
    with torch.no_grad(), auxiliary_losses() as aux:
        model(torch.randint(0, 256, (1, 8)))
    assert aux.total == 0.0


def test_dense_layers_come_first_and_experts_after():
    model = GPT(GPTConfig(seq_len=8, hidden=32, num_layers=3, moe=MoEConfig(num_experts=2, top_k=1, num_dense_layers=1)))
    kinds = [type(block.mlp).__name__ for block in model.blocks]
    assert kinds == ["MLP", "MoELayer", "MoELayer"]
    names = dict(model.named_parameters())
    assert names["blocks.1.mlp.experts.up"].shape == (2, 32, 128)  # canonical: indexed by expert


def test_a_checkpoint_manifest_round_trips_the_moe_config():
    import dataclasses

    restored = GPTConfig(**dataclasses.asdict(TINY_MOE_GPT))
    assert restored == TINY_MOE_GPT


@pytest.mark.parametrize("field,kwargs,message", [
    ("top_k", {"num_experts": 4, "top_k": 5}, "MoEConfig.top_k=5 is invalid: expected at most num_experts=4"),
    ("num_experts", {"num_experts": 0}, "MoEConfig.num_experts"),
    ("aux_loss_coef", {"aux_loss_coef": -1.0}, "MoEConfig.aux_loss_coef"),
])
def test_bad_moe_configs_name_the_field(field, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        MoEConfig(**kwargs)


def test_expert_parallel_degree_must_divide_dp_and_the_expert_count():
    with pytest.raises(ValueError, match=r"ParallelLayout.ep=3 is invalid: expected a divisor of dp=4"):
        ParallelLayout(dp=4, ep=3)
    with pytest.raises(ValueError, match=r"ParallelLayout.ep=2 is invalid with data_parallel='zero3'.*stage 1 or 2"):
        ParallelLayout(dp=4, ep=2, data_parallel="zero3")
    for data_parallel in ("fsdp2", "zero1", "zero2"):
        ParallelLayout(dp=4, ep=2, data_parallel=data_parallel)
    plugin = plugin_for(GPTConfig(seq_len=8, hidden=32, num_layers=2, moe=MoEConfig(num_experts=6, top_k=2)))
    with pytest.raises(ValueError, match=r"ParallelLayout.ep=4 is invalid: expected a divisor of MoEConfig.num_experts=6"):
        plugin.check_layout(ParallelLayout(dp=4, ep=4))
    plugin.check_layout(ParallelLayout(dp=4, ep=2))


def test_a_dense_model_refuses_expert_parallelism():
    job = TrainJob(model=GPTConfig(seq_len=8, hidden=32, num_layers=2), train=TrainConfig(num_steps=1))
    with pytest.raises(ValueError, match=r"ParallelLayout.ep=2 is invalid: GPTConfig.moe is None"):
        job.plugin.check_layout(ParallelLayout(dp=2, ep=2))


def test_layouts_with_experts_parse_and_describe():
    layout = parse_layout("dp=2,ep=2,tp=2")
    assert (layout.dp, layout.ep, layout.tp) == (2, 2, 2)
    assert layout.describe() == "DP2xEP2xTP2 (ddp)"
    assert layout.world_size == 4  # experts are split over data-parallel ranks: EP adds none


def test_a_resize_keeps_the_experts_as_sharded_as_the_new_data_parallel_degree_allows():
    from baige_ray.elastic.sizing import layout_for, valid_sizes

    job = TrainJob(model=GPTConfig(seq_len=8, hidden=32, num_layers=2, moe=MoEConfig(num_experts=4, top_k=2)),
                   train=TrainConfig(num_steps=1, global_batch_size=24))
    requested = ParallelLayout(dp=8, ep=4)
    assert [(layout.dp, layout.ep) for layout in (layout_for(requested, n, job) for n in (8, 6, 4, 2, 1))] == [
        (8, 4), (6, 2), (4, 4), (2, 2), (1, 1)]
    # 5 workers would need uneven batch shares, which would replicate every expert: not a size for EP.
    assert valid_sizes(job, requested, 1, 8) == (1, 2, 3, 4, 6, 8)
    assert valid_sizes(TrainJob(model=job.model, train=TrainConfig(num_steps=1, global_batch_size=20)),
                       requested, 1, 8) == (1, 2, 4, 5)


def test_expert_load_sums_ranks_of_one_stage_and_keeps_stages_apart():
    from baige_ray.ops.expert_load import expert_load, imbalance
    from baige_ray.ops.status import format_status

    per_rank = [[[3, 1]], [[1, 3]], [[4, 0]], []]  # stage 0: ranks 0-1; stage 1: rank 2 (rank 3 a TP peer)
    load = expert_load(per_rank, [0, 0, 1, 1])
    assert load == [[4, 4], [4, 0]]
    assert imbalance(load) == 2.0
    assert imbalance([]) == 1.0
    text = format_status({"name": "moe", "expert_load": load})
    assert "experts: imbalance 2.00 (max/mean routed tokens, worst of 2 MoE layers)" in text
    assert "[4, 0]" in text


def test_pipeline_stages_split_by_cost_when_dense_and_moe_layers_differ():
    from baige_ray.parallel.layout import balanced_stage_layers

    assert balanced_stage_layers((1.0, 1.0, 3.0, 3.0), 2) == (3, 1)
    assert balanced_stage_layers((1.0,) * 4, 2) == (2, 2)
    costs = (5.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    split = balanced_stage_layers(costs, 3)
    assert split[0] == 1 and sum(split) == 6 and min(split) >= 1
    assert max(sum(costs[sum(split[:i]):sum(split[:i + 1])]) for i in range(3)) == 5.0
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        balanced_stage_layers((1.0,) * 3, 4)
    mixed = plugin_for(GPTConfig(seq_len=16, hidden=32, num_layers=6,
                                 moe=MoEConfig(num_experts=8, top_k=4, num_dense_layers=3)))
    costs = mixed.layer_costs()
    assert costs[0] == costs[2] < costs[3] == costs[5]
    assert mixed.layers_per_stage(ParallelLayout(pp=2)) == (4, 2)  # the dense half takes one MoE layer more
    assert mixed.layers_per_stage(ParallelLayout(pp=2, stage_layers=(3, 3))) == (3, 3)  # the user's split wins
    dense = plugin_for(GPTConfig(seq_len=16, hidden=32, num_layers=5))
    assert dense.layers_per_stage(ParallelLayout(pp=2)) == (3, 2)  # equal blocks: the even split, as before


def test_expert_traffic_can_count_only_a_steps_last_forwards():
    """A pipeline's first step runs a shape-inference forward first; the engine counts the micro-batches' only."""
    from baige_ray.models.moe import ExpertTraffic

    traffic = ExpertTraffic()
    for counts in ([9, 9], [1, 2], [3, 4]):
        traffic.count(torch.tensor(counts))
    traffic.all_to_all_s = 0.5
    counts, seconds = traffic.take(last_forwards=2)
    assert counts.tolist() == [4, 6] and seconds == 0.5
    assert traffic.take() == (None, 0.0)  # taking resets
    traffic.count(torch.tensor([1, 1]))
    assert traffic.take()[0].tolist() == [1, 1]
