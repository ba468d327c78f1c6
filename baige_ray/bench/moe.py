"""Expert parallelism against replicated experts: tokens/s, the all-to-all's share of a step, expert imbalance.

One MoE GPT (the reference GPT with routed experts), the same devices, two layouts in one run:

- `replicated`: pure data parallelism, every rank holds every expert (ParallelLayout(dp=N));
- `ep`: the experts sharded over all N ranks (ParallelLayout(dp=N, ep=N)): each token visits its
  top-k experts' ranks through two uneven all-to-alls per MoE layer forward and two backward, and
  expert gradients are reduced only among the ranks holding the same experts;
- `ep_overlap`: the same, with each layer's shared experts computed while its tokens travel to
  their routed experts (MoEConfig.overlap_shared_experts);
- `ep_chunked`: EP with each layer's tokens split into `--dispatch-chunks` pipelined chunks, one
  chunk's dispatch and combine in flight while another chunk's experts compute
  (MoEConfig.dispatch_chunks; forward only, the backward all-to-alls wait).

Each layout runs in N fresh processes on gloo over 127.0.0.1 (the torch engine a baige-ray worker
runs, without Ray around it, so both layouts pay the same). A step's time is the slowest rank's;
the all-to-all share is the slowest rank's time inside expert all-to-alls over its step time;
the all-to-all time counts only waiting, so what overlap hides drops out of it; imbalance is
max / mean routed slots per expert over the global batch, the worst MoE layer, averaged over the
timed steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from baige_ray.bench.measure import free_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--expert-ffn", type=int, default=1024)
    parser.add_argument("--shared-experts", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dispatch-chunks", type=int, default=2, help="token chunks of ep_chunked")


def job_of(args: argparse.Namespace, *, overlap: bool = False, chunks: int = 1):
    from baige_ray.api.configs import TrainConfig
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.models.moe import MoEConfig

    model = GPTConfig(seq_len=args.seq_len, hidden=args.hidden, num_layers=args.layers, num_heads=4,
                      moe=MoEConfig(num_experts=args.experts, top_k=args.top_k, expert_ffn_hidden=args.expert_ffn,
                                    num_shared_experts=args.shared_experts, overlap_shared_experts=overlap,
                                    dispatch_chunks=chunks))
    train = TrainConfig(num_steps=args.warmup + args.steps, global_batch_size=args.global_batch,
                        micro_batch_size=args.micro_batch, warmup_steps=0)
    return TrainJob(model=model, train=train)


def systems_of(args: argparse.Namespace) -> dict[str, tuple[Any, Any]]:
    """name -> (job, layout) of each system compared."""
    from baige_ray.parallel.layout import ParallelLayout

    sharded = ParallelLayout(dp=args.workers, ep=args.workers)
    return {"replicated": (job_of(args), ParallelLayout(dp=args.workers)), "ep": (job_of(args), sharded),
            "ep_overlap": (job_of(args, overlap=True), sharded),
            "ep_chunked": (job_of(args, chunks=args.dispatch_chunks), sharded)}


def run(args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    compared = systems_of(args)
    for job, layout in compared.values():
        job.plugin.check_layout(layout)  # bad sizes fail here, naming the field, before any process starts
    context = mp.get_context("spawn")
    systems = {}
    for name, (job, layout) in compared.items():
        results = context.SimpleQueue()
        mp.start_processes(_rank_main, args=(layout.world_size, free_port(), job, layout, args.warmup, results),
                           nprocs=layout.world_size, start_method="spawn")
        by_rank = dict(results.get() for _ in range(layout.world_size))
        systems[name] = summarize_ranks([by_rank[rank] for rank in sorted(by_rank)], job, args.warmup)
    replicated, expert, overlapped = systems["replicated"], systems["ep"], systems["ep_overlap"]
    return {
        "benchmark": "moe",
        "model": {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden, "expert_ffn": args.expert_ffn,
                  "shared_experts": args.shared_experts, "layers": args.layers, "seq_len": args.seq_len,
                  "global_batch": args.global_batch},
        "workers": args.workers,
        "systems": systems,
        "ep_speedup": round(expert["tokens_per_s"] / replicated["tokens_per_s"], 3),
        "overlap_speedup": round(overlapped["tokens_per_s"] / expert["tokens_per_s"], 3),
        "chunked_speedup": round(systems["ep_chunked"]["tokens_per_s"] / expert["tokens_per_s"], 3),
        "dispatch_chunks": args.dispatch_chunks,
    }


def summarize_ranks(ranks: list[list[dict]], job, warmup: int) -> dict:
    """Per-rank step records -> the layout's figures over the timed steps."""
    timed = [records[warmup:] for records in ranks]
    step_s = [max(rank[i]["step_s"] for rank in timed) for i in range(len(timed[0]))]
    all_to_all_s = [max(rank[i]["all_to_all_s"] for rank in timed) for i in range(len(timed[0]))]
    imbalance = [step_imbalance([rank[i]["expert_tokens"] for rank in timed]) for i in range(len(timed[0]))]
    tokens_per_step = job.train.global_batch_size * job.plugin.seq_len
    mean_step = statistics.mean(step_s)
    return {
        "step_s": round(mean_step, 4),
        "tokens_per_s": round(tokens_per_step / mean_step, 1),
        "all_to_all_share": round(statistics.mean(a / s for a, s in zip(all_to_all_s, step_s)), 4),
        "expert_imbalance": round(statistics.mean(imbalance), 3),
        "loss_last": round(statistics.mean(rank[-1]["loss"] for rank in timed), 6),  # the global batch's
    }


def step_imbalance(per_rank_layers: list[list[list[int]]]) -> float:
    """max / mean slots per expert, summed over the ranks that counted them, for the worst layer."""
    from baige_ray.ops.expert_load import expert_load, imbalance

    return imbalance(expert_load(per_rank_layers, [0] * len(per_rank_layers)))  # no pipeline: one stage


def _rank_main(rank: int, world: int, port: int, job, layout, warmup: int, results) -> None:
    import os

    import torch
    import torch.distributed as dist

    from baige_ray.engines.factory import build_engine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one core's worth per rank, as a worker on a shared host gets
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        engine = build_engine(job, layout, rank)
        records = []
        for step in range(job.train.num_steps):
            dist.barrier()
            started = time.perf_counter()
            metrics = engine.train_step(step)
            records.append({"step_s": time.perf_counter() - started, "loss": metrics["loss"],
                            "all_to_all_s": metrics.get("all_to_all_s", 0.0),
                            "expert_tokens": metrics.get("expert_tokens", [])})
        results.put((rank, records))
    finally:
        dist.destroy_process_group()


def summarize(result: dict) -> str:
    lines = [f"MoE: {result['model']['experts']} experts top-{result['model']['top_k']} on {result['workers']} ranks"]
    for name, figures in result["systems"].items():
        lines.append(f"  {name:10s} {figures['tokens_per_s']:9.1f} tok/s  step {figures['step_s']:.3f} s  "
                     f"all-to-all {100 * figures['all_to_all_share']:.1f}%  imbalance {figures['expert_imbalance']:.2f}")
    lines.append(f"  EP / replicated: {result['ep_speedup']:.2f}x; overlap / EP: {result['overlap_speedup']:.2f}x; "
                 f"{result['dispatch_chunks']} chunks / EP: {result['chunked_speedup']:.2f}x")
    return "\n".join(lines)
