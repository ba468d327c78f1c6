"""Plain PyTorch DDP training of the reference GPT or a `transformers` model: the baseline of `bench overhead`.

Run under torchrun (`python -m torch.distributed.run --nproc_per_node 4 -m
baige_ray.bench.torchrun_ddp --settings JSON --out FILE`); rank 0 writes its step
times as JSON to FILE. `train_ddp` is also the Ray Train V2 loop body, so the two
baselines run the very same code. The mathematics match `fit` with a DDP layout:
same model and seed, same samples per rank, AdamW from `build_optimizer`,
the same learning-rate schedule and gradient clipping. With `hf_model_dir` the model is
`AutoModelForCausalLM.from_pretrained(hf_model_dir)` and the samples come from the
TokenDataset in `dataset_dir`, as a user of plain PyTorch would train it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(kw_only=True)
class DDPSettings:
    """What the baselines need to train exactly what `fit` trains; JSON-friendly."""

    model: dict[str, Any] = field(default_factory=dict)  # GPTConfig fields
    num_steps: int = 20
    global_batch_size: int = 32
    seed: int = 0
    num_threads: int = 1
    corpus_max_bytes: int = 2 * 1024 * 1024
    hf_model_dir: str | None = None  # a Hugging Face model instead of the GPT of `model`
    dataset_dir: str | None = None  # its TokenDataset
    host_allocator: str = "cached"  # every system's processes start with it (engines/host_allocator.py)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DDPSettings:
        return cls(**json.loads(text))


def train_ddp(settings: DDPSettings, on_step: Callable[[int, float, float], None] | None = None) -> list[float]:
    """Train in the already-initialised default process group; returns this rank's step times.

    A step's time runs from the end of the previous step (or the start of the first) to
    the end of this one, `on_step(step, step_time_s, loss)` included, so whatever the
    caller does per step counts as it would in a real job.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from baige_ray.api.configs import TrainConfig
    from baige_ray.engines.train_job import build_optimizer, learning_rate_at, sample_range
    from baige_ray.models.gpt import language_model_loss

    torch.set_num_threads(settings.num_threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    train = TrainConfig(num_steps=settings.num_steps, global_batch_size=settings.global_batch_size, seed=settings.seed)
    train.per_worker_batch(world)
    torch.manual_seed(settings.seed)
    module, data = _model_and_data(settings)
    model = DistributedDataParallel(module)
    optimizer = build_optimizer(model.module, train)
    times: list[float] = []
    last = time.perf_counter()
    for step in range(settings.num_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, train)
        inputs, targets = data.batch(sample_range(step, rank, world, train.global_batch_size), train.seed)
        outputs = model(inputs)
        loss = language_model_loss(getattr(outputs, "logits", outputs), targets)
        loss.backward()
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if on_step is not None:
            on_step(step, time.perf_counter() - last, loss_value)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def _model_and_data(settings: DDPSettings):
    """The model to train (seeded by the caller) and its index-addressed samples."""
    if settings.hf_model_dir is not None:
        import torch
        from transformers import AutoModelForCausalLM

        from baige_ray.models.token_dataset import TokenDataset

        model = AutoModelForCausalLM.from_pretrained(settings.hf_model_dir, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        return model, TokenDataset.open(settings.dataset_dir)
    from baige_ray.models.corpus import CorpusConfig, CorpusWindows, stdlib_corpus
    from baige_ray.models.gpt import GPT, GPTConfig

    config = GPTConfig(**settings.model)
    return GPT(config), CorpusWindows(stdlib_corpus(CorpusConfig(max_bytes=settings.corpus_max_bytes)), config.seq_len)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, help="DDPSettings as JSON")
    parser.add_argument("--out", required=True, help="rank 0 writes {'step_times_s': [...]} here")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        times = train_ddp(DDPSettings.from_json(args.settings))
        if dist.get_rank() == 0:
            with open(args.out, "w") as handle:
                json.dump({"step_times_s": times, "world_size": dist.get_world_size()}, handle)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
