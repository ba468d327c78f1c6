"""Plain sharded training of a `transformers` model under torchrun: the baseline of `bench scale`.

`python -m torch.distributed.run --standalone --nproc_per_node 2 -m baige_ray.bench.torchrun_sharded
--settings JSON --out FILE`. What a competent user writes without baige-ray, for the same model, data
and mathematics as `fit` with ParallelLayout(dp=N, data_parallel=...):

- "fsdp2": `fully_shard` on every decoder layer, then on the model (torchtitan's wrapping), with
  FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) under bf16-mixed;
- "zero3": `deepspeed.initialize` with ZeRO stage 3 (and its bf16 mode under bf16-mixed);
- one process: no wrapper, `torch.autocast(bf16)` under bf16-mixed, as `fit` runs a layout of one rank.

AdamW from `build_optimizer`, the same learning-rate schedule, clipping and samples per rank. On a GPU
host each process takes the GPU of its LOCAL_RANK and NCCL; otherwise gloo on CPU. Rank 0 writes each
step's time (from the end of the previous step), the ranks' mean loss per step and every rank's peak
resident memory (and peak allocated GPU memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import time
from dataclasses import asdict, dataclass


@dataclass(kw_only=True)
class ShardedSettings:
    model_dir: str
    dataset_dir: str
    seq_len: int
    data_parallel: str  # "fsdp2" or "zero3"
    num_steps: int
    global_batch_size: int
    precision: str = "bf16-mixed"
    seed: int = 0
    num_threads: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _train_config(settings: ShardedSettings):
    from baige_ray.api.configs import TrainConfig

    return TrainConfig(num_steps=settings.num_steps, global_batch_size=settings.global_batch_size,
                       seed=settings.seed, precision=settings.precision)


def _fsdp2(model, train):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if train.precision == "bf16-mixed" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return _plain_step(model, train, contextlib.nullcontext)


def _single(model, train):
    import torch

    device_type = next(model.parameters()).device.type
    if train.precision == "bf16-mixed":
        return _plain_step(model, train, lambda: torch.autocast(device_type, dtype=torch.bfloat16))
    return _plain_step(model, train, contextlib.nullcontext)


def _plain_step(model, train, precision):
    import torch

    from baige_ray.engines.train_job import build_optimizer

    optimizer = build_optimizer(model, train)

    def step(inputs, targets, learning_rate) -> float:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        with precision():
            loss = _loss(model(inputs).logits, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _zero3(model, train, per_rank_batch: int):
    import os

    import deepspeed
    import torch.distributed as dist

    from baige_ray.engines.train_job import build_optimizer

    os.environ.setdefault("LOCAL_RANK", "0")
    config = {"train_micro_batch_size_per_gpu": per_rank_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": train.grad_clip, "steps_per_print": 2**31,
              "bf16": {"enabled": train.precision == "bf16-mixed"}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, train),
                                                   config=config, dist_init_required=not dist.is_initialized())

    def step(inputs, targets, learning_rate) -> float:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        loss = _loss(engine(inputs).logits, targets)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


def _loss(logits, targets):
    """Next-token cross entropy in fp32, as fit's loss (ModelPlugin.loss) computes it."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def train_sharded(settings: ShardedSettings) -> tuple[list[float], list[float]]:
    """(step times, losses) of this rank; the default process group is initialised."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from baige_ray.engines.train_job import learning_rate_at, sample_range
    from baige_ray.models.token_dataset import TokenDataset

    torch.set_num_threads(settings.num_threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    train = _train_config(settings)
    per_rank = train.per_worker_batch(world)
    device = _device()
    model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
    data = TokenDataset.open(settings.dataset_dir)
    if world == 1:
        step = _single(model, train)
    else:
        step = _fsdp2(model, train) if settings.data_parallel == "fsdp2" else _zero3(model, train, per_rank)
    times, losses = [], []
    last = time.perf_counter()
    for index in range(settings.num_steps):
        inputs, targets = data.batch(sample_range(index, rank, world, train.global_batch_size), train.seed)
        losses.append(step(inputs.to(device), targets.to(device), learning_rate_at(index, train)))
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times, losses


def _device():
    import os

    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, help="ShardedSettings as JSON")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = _device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        times, losses = train_sharded(ShardedSettings(**json.loads(args.settings)))
        device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, device_peak],
                            dtype=torch.float64, device=device)
        peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(peaks, peak)
        mean_losses = torch.tensor(losses, dtype=torch.float64, device=device)  # each rank's own batch: their mean
        dist.all_reduce(mean_losses)
        mean_losses /= dist.get_world_size()
        if dist.get_rank() == 0:
            with open(args.out, "w") as handle:
                json.dump({"step_times_s": times, "losses": mean_losses.tolist(),
                           "peak_host_memory_bytes": [int(p[0].item()) for p in peaks],
                           "peak_device_memory_bytes": [int(p[1].item()) for p in peaks]}, handle)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
