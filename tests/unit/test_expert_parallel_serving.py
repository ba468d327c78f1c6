"""Expert-parallel serving: experts spread over three processes, re-placed from observed load.

Rank 0 serves a tiny MoE GPT whose router sends most slots to expert 3; ranks 1 and 2 hold only
their slots' experts. Greedy tokens must equal one process's before and after a re-placement,
and the re-placement (the hot expert copied onto more ranks) must spread the same traffic more
evenly over the ranks.
"""

import os

import torch
import torch.distributed as dist

from tests.helpers import spawn_ranks

from ..moe_helpers import HOT_EXPERT, greedy_tokens, skewed_moe_gpt


def _rank(rank: int, port: int, results) -> None:
    from baige_ray.serving.expert_parallel import ExpertDispatcher, ExpertParallelServing, layer_specs, serve_experts

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    options = ExpertParallelServing(ranks=3, slots_per_rank=2, rebalance_every=None)
    _, model = skewed_moe_gpt()
    layers = [block.mlp for block in model.blocks]
    if rank > 0:
        results[rank] = serve_experts(layer_specs(layers), options)
    else:
        alone = greedy_tokens(model)
        dispatcher = ExpertDispatcher(layers, options)
        spread = greedy_tokens(model)
        before = dispatcher.rebalance()  # from the load the first pass routed
        rebalanced = greedy_tokens(model)
        after = dispatcher.stats()
        dispatcher.close()
        results[0] = {"alone": alone, "spread": spread, "rebalanced": rebalanced, "before": before, "after": after}
    _leave_group()


def test_experts_over_three_ranks_generate_one_process_tokens_and_rebalancing_evens_the_load():
    results = spawn_ranks(_rank, 3)
    outcome = results[0]
    assert outcome["spread"] == outcome["alone"]
    assert outcome["rebalanced"] == outcome["alone"]
    assert results[1] > 0 and results[2] > 0  # layer forwards the expert ranks ran
    before, after = outcome["before"], outcome["after"]
    assert sum(after["rank_rows"]) == sum(before["rank_rows"])  # the same traffic, placed anew
    for slots in after["slots"]:
        assert slots.count(HOT_EXPERT) >= 2  # the hot expert copied
    assert after["imbalance"] < before["imbalance"], (before, after)
    print(f"rows per rank {before['rank_rows']} -> {after['rank_rows']}, imbalance {before['imbalance']:.3f} -> "
          f"{after['imbalance']:.3f}")


def _mixtral_rank(rank: int, port: int, results) -> None:
    """transformers' Mixtral: its experts replaced by RoutedExperts, spread over two ranks."""
    from baige_ray.models.hf import HFModel
    from baige_ray.models.hf.decoding import HFDecoder
    from baige_ray.models.plugin import plugin_for
    from baige_ray.serving.causal_lm_generation import SamplingParams
    from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, generate_all
    from baige_ray.serving.expert_parallel import ExpertDispatcher, ExpertParallelServing, layer_specs, serve_experts

    from ..hf_helpers import mixtral_config

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    plugin = plugin_for(HFModel.from_config(mixtral_config()))
    torch.manual_seed(0)
    model = plugin.build_inference_model(plugin.build_model().state_dict())
    options = ExpertParallelServing(ranks=2, slots_per_rank=3, rebalance_every=5)

    def greedy() -> list[list[int]]:
        engine = ContinuousBatchingEngine(HFDecoder(model, max_context=128), eos_token_id=None,
                                          limits=EngineLimits(max_waiting=3))
        prompts = [[5, 17, 42, 99], [7, 7, 7], [300, 2, 150, 60, 11]]
        params = [SamplingParams(max_new_tokens=10, temperature=0.0)] * 3
        return [generation.tokens for generation in generate_all(engine, prompts, params)]

    alone = greedy()  # transformers' own experts
    layers = plugin.inference_expert_layers(model)
    if rank > 0:
        results[rank] = serve_experts(layer_specs(layers), options)
    else:
        dispatcher = ExpertDispatcher(layers, options)
        spread = greedy()
        results[0] = {"alone": alone, "spread": spread, "placements": dispatcher.stats()["placements_made"]}
        dispatcher.close()
    _leave_group()


def _leave_group() -> None:
    # Every rank past its last message before any destroys the group: rank 0 destroying it while a peer
    # still read the stop broadcast aborted once in gloo ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def test_a_mixtral_served_over_two_expert_ranks_generates_transformers_tokens():
    results = spawn_ranks(_mixtral_rank, 2)
    assert results[0]["spread"] == results[0]["alone"]
    assert results[0]["placements"] >= 2 and results[1] > 0
