"""Long context in training: context parallelism on gloo ranks of this machine (the training half of
`bench longctx`, issue #78).

A Llama-architecture model built from its config with `transformers` and saved; ranks are processes on
127.0.0.1 (gloo), each running the torch engine's own step (`TorchEngine.forward_backward`) on random
tokens. Memory is what autograd keeps for backward (bench/saved_activations.py: every saved storage
once, parameters excluded), the quantity the planner's activation model prices; the transient keys of
the one layer attending at a time are not in it.

- Longest sequence under a fixed memory cap: the cap is what one rank keeps at `--cap-tokens` without
  context parallelism; for CP1, CP2 and CP4, ring and Ulysses, the longest sequence (in steps of
  64 x cp tokens) whose largest rank keeps no more. `max_seq_cp4_vs_cp1` is ring CP4's over CP1's.
- `cp_memory_error`: the largest relative difference between a rank's measured bytes and the planner's
  (planner/memory.py: activations and logits of its 1/cp of the tokens) over those runs at their
  longest sequence; `sp_memory_error` the same for TP2 and TP4 with sequence parallelism at the cap's
  length (bytes of every rank's step against the planner's for that TP degree).
- Step time at equal tokens (`--step-tokens`): seconds per step of each CP layout against CP1. On two
  cores four ranks share two: CP4's time is the machine's, not the method's.
- Bytes sent per layer against planner/context_parallel.py's formula.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 65536}
QUICK_SHAPE = {**MODEL_SHAPE, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 8192}
LAYOUTS = ("cp=2", "cp=2,cpkind=ulysses", "cp=4", "cp=4,cpkind=ulysses")
SP_LAYOUTS = ("tp=2", "tp=4")


def build_model(directory: Path, shape: dict) -> Path:
    """A saved Llama of `shape` with seeded random weights, and a small dataset the engine opens."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    model_dir = directory / "model"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.float32).save_pretrained(model_dir)
    return model_dir


def _engine(model_dir: str, text: str, rank: int, length: int):
    from baige_ray import TrainConfig
    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from baige_ray.parallel.layout import parse_layout

    layout = parse_layout(text) if text != "cp=1" else parse_layout("dp=1")
    job = TrainJob(model=HFModel(model_dir, seq_len=length), train=TrainConfig(num_steps=1, global_batch_size=1))
    return build_engine(job, layout, rank, data=_RandomTokens(length))


@dataclasses.dataclass(frozen=True)
class _RandomTokens:
    """Seeded random token sequences of `length`, addressed by sample index (a SampleSource)."""

    length: int
    vocab: int = 256
    fingerprint: str = "random-tokens"

    def batch(self, indices, seed: int):
        import torch

        rows = [torch.randint(0, self.vocab, (self.length + 1,), generator=torch.Generator().manual_seed(seed + i))
                for i in indices]
        tokens = torch.stack(rows)
        return tokens[:, :-1], tokens[:, 1:]


def _saved_bytes(engine, length: int) -> tuple[int, int]:
    """What one step keeps for backward on this rank (each storage once, parameters excluded): in all, and
    inside the decoder layers (what planner/memory.py's per-layer model prices)."""
    import torch

    from baige_ray.engines.parallelize import local

    inputs, targets = engine.data.batch(range(1), 0)
    engine.tokens_per_sample = float(length)  # every target is trained
    parameters = {local(p).untyped_storage().data_ptr() for p in engine.module.parameters()}
    in_layer = [False]
    hooks = []
    for layer in engine.stages[0].layers.values():
        hooks.append(layer.register_forward_pre_hook(lambda *_: in_layer.__setitem__(0, True)))
        hooks.append(layer.register_forward_hook(lambda *_: in_layer.__setitem__(0, False)))
    everywhere: dict[int, int] = {}
    in_layers: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in parameters:
            everywhere[storage.data_ptr()] = storage.nbytes()
            if in_layer[0]:
                in_layers[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        engine.forward_backward(inputs, targets)
    for hook in hooks:
        hook.remove()
    engine.optimizer.zero_grad(set_to_none=True)
    return sum(everywhere.values()), sum(in_layers.values())


def _step_seconds(engine, steps: int) -> float:
    from baige_ray.parallel import context_parallel

    inputs, targets = engine.data.batch(range(1), 0)
    engine.tokens_per_sample = float(inputs.shape[1])
    times = []
    context_parallel.SENT.take()
    for _ in range(steps + 1):  # the first warms up
        started = time.perf_counter()
        engine.forward_backward(inputs, targets)
        engine.optimizer_step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def _rank_main(rank: int, world: int, port: int, task: dict, results) -> None:
    import torch
    import torch.distributed as dist

    from baige_ray.parallel import context_parallel

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for text, probes in task["memory"].items():
            for length in probes:
                results[("memory", text, length, rank)] = _saved_bytes(_engine(task["model"], text, rank, length), length)
        for text in task["timing"]:
            engine = _engine(task["model"], text, rank, task["step_tokens"])
            results[("step_s", text, rank)] = _step_seconds(engine, task["steps"])
            results[("sent", text, rank)] = context_parallel.SENT.take() / (task["steps"] + 1)
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_ranks(world: int, task: dict) -> dict:
    """`task` on `world` gloo ranks (processes spawned here; one rank runs in this process)."""
    import torch.multiprocessing as mp

    from baige_ray.bench.measure import free_port

    if world == 1:
        results: dict = {}
        _rank_main(0, 1, 0, task, results)
        return results
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        port = free_port()
        processes = [context.Process(target=_rank_main, args=(rank, world, port, task, results))
                     for rank in range(world)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=1800)
        failed = [p.exitcode for p in processes if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"a rank of {world} failed (exit codes {failed})")
        return dict(results)


def planned_layer_bytes(model_dir: Path, text: str, length: int) -> float:
    """The planner's activation bytes of one rank's decoder layers for one sequence of `length`, in fp32."""
    import json

    import numpy as np

    from baige_ray.parallel.layout import parse_layout
    from baige_ray.planner.memory import activation_bytes_per_layer
    from baige_ray.planner.model_spec import ModelSpec

    layout = parse_layout(text) if text != "cp=1" else parse_layout("dp=1")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    spec = ModelSpec.from_hf_config(config, global_batch=1, seq_len=length, dtype_bytes=4)
    per_layer = activation_bytes_per_layer(spec, 1, np.array(0), layout.tp, layout.sequence_parallel, layout.cp)
    return float(per_layer) * spec.num_layers * 4 / 2  # the model prices 2-byte activations; these run in fp32


def _probes(cap_tokens: int, cp: int) -> list[int]:
    step = 64 * cp
    return [cap_tokens * k // step * step for k in (1, 2)]


def longest_under(samples: dict[int, float], cap: float, step: int, measure) -> int:
    """The longest multiple of `step` whose bytes stay under `cap`: an affine fit of `samples`, then
    checked by `measure(length)` and moved a step at a time until it holds and the next does not."""
    (x0, y0), (x1, y1) = sorted(samples.items())[:2]
    slope = (y1 - y0) / (x1 - x0)
    length = max(step, int((x0 + (cap - y0) / slope) // step * step))
    while length > step and measure(length) > cap:
        length -= step
    while measure(length + step) <= cap:
        length += step
    return length


def run(args) -> dict[str, Any]:
    from baige_ray.planner.context_parallel import context_parallel_bytes_per_layer
    from baige_ray.planner.model_spec import ModelSpec

    shape = QUICK_SHAPE if args.quick else MODEL_SHAPE
    cap_tokens = 256 if args.quick else args.cap_tokens
    step_tokens = 512 if args.quick else args.step_tokens
    steps = 2 if args.quick else 3
    work = Path(tempfile.mkdtemp(prefix="longctx-"))
    model_dir = str(build_model(work, shape))
    base = {"model": model_dir, "step_tokens": step_tokens, "steps": steps}

    one = run_ranks(1, {**base, "memory": {"cp=1": _probes(cap_tokens, 1)}, "timing": ["cp=1"]})
    cap = one[("memory", "cp=1", cap_tokens, 0)][0]
    by_world: dict[int, dict] = {1: one}
    for world in (2, 4):
        layouts = [text for text in LAYOUTS if f"cp={world}" in text]
        sp = [text for text in SP_LAYOUTS if text == f"tp={world}"]
        memory = {text: _probes(cap_tokens, world) for text in layouts}
        memory.update({text: [cap_tokens] for text in sp})
        by_world[world] = run_ranks(world, {**base, "memory": memory, "timing": layouts})

    def largest_rank(results: dict, text: str, length: int, world: int, part: int = 0) -> float:
        """Of every rank's bytes kept for backward (part 0: in all, 1: in the decoder layers), the most."""
        return max(results[("memory", text, length, rank)][part] for rank in range(world))

    longest, memory_errors = {}, {}
    for text in ("cp=1", *LAYOUTS):
        world = 1 if text == "cp=1" else int(text.split(",")[0].split("=")[1])
        results = by_world[world]
        samples = {length: largest_rank(results, text, length, world) for length in _probes(cap_tokens, world)}
        layer_bytes = {length: largest_rank(results, text, length, world, 1) for length in samples}

        def measure(length: int, text=text, world=world, samples=dict(samples)) -> float:
            if length not in samples:
                extra = run_ranks(world, {**base, "memory": {text: [length]}, "timing": []})
                samples[length] = largest_rank(extra, text, length, world)
                layer_bytes[length] = largest_rank(extra, text, length, world, 1)
            return samples[length]

        longest[text] = longest_under(samples, cap, 64 * world, measure)
        measure(longest[text])
        memory_errors[text] = abs(layer_bytes[longest[text]] / planned_layer_bytes(model_dir, text, longest[text]) - 1)
    sp_errors = {text: abs(largest_rank(by_world[int(text[3:])], text, cap_tokens, int(text[3:]), 1)
                           / planned_layer_bytes(model_dir, text, cap_tokens) - 1) for text in SP_LAYOUTS}

    import json

    spec = ModelSpec.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()), global_batch=1,
                                    seq_len=step_tokens, dtype_bytes=4)
    cp1_step = one[("step_s", "cp=1", 0)]
    timing, traffic = {}, {}
    for text in LAYOUTS:
        world = int(text.split(",")[0].split("=")[1])
        results = by_world[world]
        step_s = max(results[("step_s", text, rank)] for rank in range(world))
        timing[text] = {"step_s": step_s, "vs_cp1": cp1_step / step_s}
        kind = "ulysses" if "ulysses" in text else "ring"
        sent = results[("sent", text, 0)] / spec.num_layers
        formula = context_parallel_bytes_per_layer(spec, cp=world, kind=kind, micro_batch=1)
        traffic[text] = {"sent_per_layer_bytes": sent, "formula_bytes": formula, "ratio": sent / formula}
    return {
        "max_seq_cp4_vs_cp1": longest["cp=4"] / longest["cp=1"],
        "sp_memory_error": max(sp_errors.values()),
        "cp_memory_error": max(memory_errors.values()),
        "longest_sequence": longest,
        "memory_cap_bytes": cap,
        "memory_error_by_layout": {**memory_errors, **sp_errors},
        "step_time": {"cp=1": {"step_s": cp1_step}, **timing, "tokens": step_tokens},
        "bytes_per_layer": traffic,
        "model": shape,
    }
