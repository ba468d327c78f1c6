"""A tiny mixture-of-experts GPT whose routers favour one expert, for expert-placement tests."""

from __future__ import annotations

import torch

PROMPTS = ("def main():", "import os\n", "class A:")
HOT_EXPERT = 3


def skewed_moe_gpt(seed: int = 0):
    """(config, model): 4 experts, top-2; each router's HOT_EXPERT row points along that router's mean
    input over greedy generations of PROMPTS, so that expert receives most slots."""
    from baige_ray.models.gpt import GPT, GPTConfig
    from baige_ray.models.moe import MoEConfig

    config = GPTConfig(seq_len=48, hidden=32, num_layers=2, num_heads=4, moe=MoEConfig(num_experts=4, top_k=2))
    torch.manual_seed(seed)
    model = GPT(config).eval()
    inputs: dict[int, list[torch.Tensor]] = {}
    hooks = [block.mlp.router.register_forward_pre_hook(
        lambda _, args, index=index: inputs.setdefault(index, []).append(args[0]))
        for index, block in enumerate(model.blocks)]
    greedy_tokens(model)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for index, block in enumerate(model.blocks):
            mean = torch.cat(inputs[index]).mean(dim=0)
            block.mlp.router.gate.weight[HOT_EXPERT] = 6.0 * mean / mean.norm() ** 2
    return config, model


def greedy_tokens(model, max_new_tokens: int = 12) -> list[list[int]]:
    """Greedy continuations of PROMPTS (bytes) by the built-in engine on this process."""
    from baige_ray.models.gpt_decoding import GPTDecoder
    from baige_ray.serving.causal_lm_generation import SamplingParams
    from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, generate_all

    engine = ContinuousBatchingEngine(GPTDecoder(model), eos_token_id=None, limits=EngineLimits(max_waiting=len(PROMPTS)))
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)] * len(PROMPTS)
    return [generation.tokens for generation in generate_all(engine, [list(p.encode()) for p in PROMPTS], params)]
