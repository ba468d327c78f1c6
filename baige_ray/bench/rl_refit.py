"""Refit for `bench rl`: the policy's new weights into a running rollout replica from memory, against
through a checkpoint written as a Hugging Face directory (what a trainer and an engine that share no
memory do: write, then the engine reads it back and verifies it).

Twice: for the bench's tiny policy on the simulated cluster, and at the size refits cost something, a
model with the published configuration of Qwen2.5-0.5B (494M parameters, fp32, fresh weights) served
by one built-in replica on a plain local Ray (the simulated nodes' object stores are 128 MiB). The
first refit of that model is reported apart (the object store's memory is touched for the first time);
the next ones run in steady state, as an RL run's iterations do.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from baige_ray.catalog import published_model

LARGE_CONFIG = published_model("qwen2.5-0.5b")
STEADY_ROUNDS = 3


def refit_seconds(info, model, weights: dict, directory: Path) -> tuple[float, float]:
    """(from memory, through a checkpoint) seconds until every replica of `info` serves `weights`."""
    import ray

    from baige_ray.models.plugin import plugin_for
    from baige_ray.parallel.packed_tensors import pack_tensors
    from baige_ray.serving.app import reload_weights

    state = ray.put(pack_tensors(weights))  # as the training job hands its snapshot over
    started = time.perf_counter()
    reload_weights(info, (1, state), model_config=model, timeout_s=600, keep_copy=False)  # as GRPOTrainer does
    memory_s = time.perf_counter() - started
    del state
    started = time.perf_counter()
    written = plugin_for(model).save_final(directory, weights, step=2)
    reload_weights(info, written, model_config=model, timeout_s=600)  # read, verified, then in place as well
    return memory_s, time.perf_counter() - started


def tiny_refit(model_dir: Path, final_state, work: Path, seq_len: int) -> dict[str, float]:
    import ray

    from baige_ray.models.hf import HFModel
    from baige_ray.serving.app import serve, shutdown

    model = HFModel(model_dir, seq_len=seq_len)
    info = serve(model_dir, model_config=model, name="bench-rl-refit", port=8017)
    try:
        memory_s, checkpoint_s = refit_seconds(info, model, ray.get(final_state)["model"], work / "refit-checkpoint")
    finally:
        shutdown(info)
    return {"memory_s": memory_s, "checkpoint_s": checkpoint_s}


def large_refit(tokenizer_dir: Path, work: Path) -> dict[str, Any]:
    """The refit of a Qwen2.5-0.5B-sized policy on a local Ray of this machine."""
    from baige_ray.models.hf import HFModel
    from baige_ray.models.plugin import plugin_for
    from baige_ray.serving.app import serve, shutdown
    from baige_ray.topology.connect import open_cluster

    large = work / "refit-large"  # 2 GB a directory: removed once measured
    model_dir = _large_policy(tokenizer_dir, large / "qwen2.5-0.5b-fresh")
    model = HFModel(model_dir, seq_len=64)
    weights = plugin_for(model).read_directory_weights()
    rounds = []
    try:
        with open_cluster(local_num_cpus=2, local_num_gpus=1, log_to_driver=False):
            info = serve(model_dir, model_config=model, name="bench-rl-refit-large", port=8017, max_batch_size=2)
            try:
                for index in range(1 + STEADY_ROUNDS):
                    rounds.append(refit_seconds(info, model, weights, large / f"checkpoint-{index}"))
                    shutil.rmtree(large / f"checkpoint-{index}")
            finally:
                shutdown(info)
    finally:
        shutil.rmtree(large, ignore_errors=True)
    memory = statistics.median(m for m, _ in rounds[1:])
    checkpoint = statistics.median(c for _, c in rounds[1:])
    return {"parameters": sum(t.numel() for t in weights.values()), "first_memory_s": rounds[0][0],
            "first_checkpoint_s": rounds[0][1], "memory_s": memory, "checkpoint_s": checkpoint,
            "ratio": checkpoint / memory}


def _large_policy(tokenizer_dir: Path, model_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    config = Qwen2Config(**json.loads(LARGE_CONFIG.read_text()))  # the vocabulary stays the config's
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(model_dir)
    return model_dir
