"""Expert-parallel serving: experts spread over three processes, re-placed from observed load.

Rank 0 serves a tiny MoE GPT whose router sends most slots to expert 3; ranks 1 and 2 hold only
their slots' experts. Greedy tokens must equal one process's before and after a re-placement,
and the re-placement (the hot expert copied onto more ranks) must spread the same traffic more
evenly over the ranks.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROMPTS = [list(b"def main():"), list(b"import os\n"), list(b"class A:")]
HOT_EXPERT = 3


def _skewed_moe_gpt():
    """A tiny MoE GPT whose routers favour HOT_EXPERT (its gate row points along the routers' mean input)."""
    from baige_ray.models.gpt import GPT, GPTConfig
    from baige_ray.models.moe import MoEConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=48, hidden=32, num_layers=2, num_heads=4,
                          moe=MoEConfig(num_experts=4, top_k=2))).eval()
    inputs = {}
    hooks = [block.mlp.router.register_forward_pre_hook(
        lambda _, args, index=index: inputs.setdefault(index, []).append(args[0])) for index, block in
        enumerate(model.blocks)]
    _generate(model)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for index, block in enumerate(model.blocks):
            mean = torch.cat(inputs[index]).mean(dim=0)
            block.mlp.router.gate.weight[HOT_EXPERT] = 6.0 * mean / mean.norm() ** 2
    return model


def _generate(model) -> list[list[int]]:
    from baige_ray.serving.causal_lm_generation import SamplingParams
    from baige_ray.serving.decoders import GPTDecoder
    from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, generate_all

    engine = ContinuousBatchingEngine(GPTDecoder(model), eos_token_id=None, limits=EngineLimits(max_waiting=3))
    params = [SamplingParams(max_new_tokens=12, temperature=0.0)] * len(PROMPTS)
    return [generation.tokens for generation in generate_all(engine, PROMPTS, params)]


def _rank(rank: int, port: int, results) -> None:
    from baige_ray.serving.expert_parallel import ExpertDispatcher, ExpertParallelServing, layer_specs, serve_experts

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    options = ExpertParallelServing(ranks=3, slots_per_rank=2, rebalance_every=None)
    model = _skewed_moe_gpt()
    layers = [block.mlp for block in model.blocks]
    if rank > 0:
        results[rank] = serve_experts(layer_specs(layers), options)
    else:
        alone = _generate(model)
        dispatcher = ExpertDispatcher(layers, options)
        spread = _generate(model)
        before = dispatcher.rebalance()  # from the load the first pass routed
        rebalanced = _generate(model)
        after = dispatcher.stats()
        dispatcher.close()
        results[0] = {"alone": alone, "spread": spread, "rebalanced": rebalanced, "before": before, "after": after}
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_experts_over_three_ranks_generate_one_process_tokens_and_rebalancing_evens_the_load():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(_free_port(), results), nprocs=3, start_method="spawn")
        results = dict(results)
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
