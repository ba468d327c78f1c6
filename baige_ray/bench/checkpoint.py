"""Flash checkpoint cost: per-step host snapshot stall against step time; persistence against a plain file write.

One engine trains a ~100M-parameter reference GPT in this process (768 wide, 14
layers, 128 positions: 99,723,264 parameters; 8 sequences a step, so that it runs
in about two minutes on two cores). A `HostSnapshotter` is attached throughout, and after the
warm-up, blocks of steps without snapshots alternate with blocks that snapshot
after every step, so slow drift on a shared machine hits both alike:

- a `plain` step neither starts a snapshot nor has one copying beside it;
- a `snapshot` step has the previous step's copy running beside it and starts its own;
- the first step of each block is a transition (one of the two only) and is left out.

A step's cost is the wall time of `train_step` plus that of `after_step` when called.
`step_s` is the median plain step, `stall_s` the median snapshot step minus `step_s`
(floored at 0; the raw medians are reported too), `fence_wait_s` the median time the
optimizer update waited for a copy. Other load on a shared machine only ever adds time,
so `stall_min_s` (fastest snapshot step minus fastest plain step) is reported beside
the median as the estimate least touched by it. Persistence times `write_checkpoint` of the newest
snapshot (model and AdamW state, SHA-256, fsync, commit marker) and, for reference,
the same bytes written as one plain file with one fsync. GB/s are 10^9 bytes a second.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLAIN, SNAPSHOT = "plain", "snapshot"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=14)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=3, help="snapshotting steps left out of the statistics")
    parser.add_argument("--block", type=int, default=3, help="steps per block with or without snapshots")
    parser.add_argument("--cycles", type=int, default=3, help="pairs of blocks (plain, snapshot)")
    parser.add_argument("--write-repeats", type=int, default=2, help="timed writes of each kind; the best counts")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--device", default="cpu", help="the engine's device (cpu, cuda)")


def snapshot_schedule(warmup: int, block: int, cycles: int) -> list[bool]:
    """Whether to snapshot after each step: `warmup` snapshotting steps, then (plain, snapshot) block pairs."""
    if warmup < 1 or block < 2 or cycles < 1:
        raise ValueError(f"warmup={warmup}, block={block}, cycles={cycles}: expected >= 1, >= 2, >= 1")
    return [True] * warmup + ([False] * block + [True] * block) * cycles


def classify_steps(snapshot_after: Sequence[bool], warmup: int) -> list[str | None]:
    """PLAIN, SNAPSHOT, or None (warm-up or transition) for each step of a schedule."""
    kinds: list[str | None] = []
    for index, snapshots in enumerate(snapshot_after):
        copy_beside = index > 0 and snapshot_after[index - 1]
        if index < warmup or copy_beside != snapshots:
            kinds.append(None)
        else:
            kinds.append(SNAPSHOT if snapshots else PLAIN)
    return kinds


def checkpoint_result(
    *,
    params: int,
    kinds: Sequence[str | None],
    step_s: Sequence[float],
    fence_wait_s: Sequence[float],
    state_bytes: int,
    persist_s: float,
    file_write_s: float,
) -> dict[str, Any]:
    """The benchmark's JSON from measured samples (one entry of kinds / step_s / fence_wait_s per step)."""
    plain = [t for t, kind in zip(step_s, kinds, strict=True) if kind == PLAIN]
    snapshot = [t for t, kind in zip(step_s, kinds, strict=True) if kind == SNAPSHOT]
    waits = [t for t, kind in zip(fence_wait_s, kinds, strict=True) if kind == SNAPSHOT]
    if not plain or not snapshot:
        raise ValueError(f"need plain and snapshot steps, got {len(plain)} and {len(snapshot)}")
    if persist_s <= 0 or file_write_s <= 0:
        raise ValueError(f"write times must be positive: persist_s={persist_s}, file_write_s={file_write_s}")
    plain_median, snapshot_median = statistics.median(plain), statistics.median(snapshot)
    stall = max(0.0, snapshot_median - plain_median)
    persist_gbps, file_gbps = state_bytes / persist_s / 1e9, state_bytes / file_write_s / 1e9
    return {
        "params": params,
        "step_s": round(plain_median, 4),
        "stall_s": round(stall, 4),
        "stall_frac": round(stall / plain_median, 4),
        "persist_gbps": round(persist_gbps, 3),
        "file_write_gbps": round(file_gbps, 3),
        "persist_vs_file": round(persist_gbps / file_gbps, 3),
        "snapshot_step_s": round(snapshot_median, 4),
        "step_min_s": round(min(plain), 4),
        "stall_min_s": round(max(0.0, min(snapshot) - min(plain)), 4),
        "fence_wait_s": round(statistics.median(waits), 4),
        "num_plain_steps": len(plain),
        "num_snapshot_steps": len(snapshot),
        "state_bytes": state_bytes,
        "persist_s": round(persist_s, 3),
        "file_write_s": round(file_write_s, 3),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    schedule = snapshot_schedule(args.warmup, args.block, args.cycles)
    engine = _build_engine(args, num_steps=len(schedule))
    params = sum(p.numel() for p in engine.module.parameters())
    step_s, fence_wait_s, (step, state) = _train(engine, schedule)
    with tempfile.TemporaryDirectory(prefix="baige-bench-checkpoint-", dir=args.dir) as directory:
        state_bytes, persist_s, file_write_s = _time_writes(Path(directory), step, state, args.write_repeats)
    result = checkpoint_result(
        params=params, kinds=classify_steps(schedule, args.warmup), step_s=step_s, fence_wait_s=fence_wait_s,
        state_bytes=state_bytes, persist_s=persist_s, file_write_s=file_write_s,
    )
    result["model"] = {"hidden": args.hidden, "num_layers": args.num_layers, "seq_len": args.seq_len,
                       "batch": args.batch, "device": args.device}
    result["step_times_s"] = [round(t, 4) for t in step_s]
    return result


def _build_engine(args: argparse.Namespace, num_steps: int):
    from baige_ray.api.configs import TrainConfig
    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.corpus import CorpusConfig
    from baige_ray.models.gpt import GPTConfig
    from baige_ray.parallel.layout import ParallelLayout

    model = GPTConfig(hidden=args.hidden, num_layers=args.num_layers, num_heads=args.num_heads, seq_len=args.seq_len)
    train = TrainConfig(num_steps=num_steps, global_batch_size=args.batch, warmup_steps=1)
    job = TrainJob(model=model, train=train, data=CorpusConfig(max_bytes=2 * 1024 * 1024))
    return build_engine(job, ParallelLayout(), device=args.device)


def _train(engine, schedule: Sequence[bool]) -> tuple[list[float], list[float], tuple]:
    """Per-step cost and fence wait; the newest snapshot at the end."""
    import time

    from baige_ray.elastic.snapshot import HostSnapshotter

    snapshotter = HostSnapshotter(engine)
    step_s, fence_wait_s = [], []
    for step, snapshots in enumerate(schedule):
        started = time.perf_counter()
        engine.train_step(step)
        fence_wait_s.append(snapshotter.last_stall_s)
        if snapshots:
            snapshotter.after_step(step)
        step_s.append(time.perf_counter() - started)
    return step_s, fence_wait_s, snapshotter.latest()


def _time_writes(directory: Path, step: int, state: dict, repeats: int) -> tuple[int, float, float]:
    """Bytes of the state, and the best of `repeats` times of write_checkpoint and of a plain file write."""
    import shutil
    import time

    from baige_ray.checkpoint.store import flatten_optimizer, write_checkpoint
    from baige_ray.checkpoint.tensor_file import tensor_bytes

    tensors = [*state["model"].values(), *flatten_optimizer(state["optimizer"]).values()]
    persist, plain = [], []
    for attempt in range(repeats):  # alternated, so drift in the disk's speed hits both alike
        started = time.perf_counter()
        written = write_checkpoint(directory / "store", step + attempt, state, meta={"bench": "checkpoint"})
        persist.append(time.perf_counter() - started)
        shutil.rmtree(written)
        plain.append(_write_plain_file(directory / "plain.bin", tensors))
        (directory / "plain.bin").unlink()
    return tensor_bytes(state["model"]) + tensor_bytes(flatten_optimizer(state["optimizer"])), min(persist), min(plain)


def _write_plain_file(path: Path, tensors: Sequence) -> float:
    """Seconds to write the tensors' bytes back to back into one file, fsync it and its directory."""
    import time

    from baige_ray.checkpoint.files import fsync_path
    from baige_ray.checkpoint.tensor_file import host_bytes

    started = time.perf_counter()
    with path.open("wb") as handle:
        for tensor in tensors:
            handle.write(host_bytes(tensor))
        handle.flush()
        os.fsync(handle.fileno())
    fsync_path(path.parent)
    return time.perf_counter() - started


def summarize(result: dict[str, Any]) -> str:
    return "\n".join([
        f"model: {result['params']:,} parameters, {result['state_bytes'] / 1e9:.2f} GB of model + optimizer state",
        f"step: {result['step_s']:.3f} s plain, {result['snapshot_step_s']:.3f} s with a snapshot every step "
        f"({result['num_plain_steps']} / {result['num_snapshot_steps']} steps)",
        f"stall: {result['stall_s']:.3f} s = {result['stall_frac']:.1%} of a step "
        f"(the update waited {result['fence_wait_s']:.3f} s for the copy); fastest steps: "
        f"{result['step_min_s']:.3f} s plain, stall {result['stall_min_s']:.3f} s",
        f"persist: {result['persist_gbps']:.3f} GB/s ({result['persist_s']:.2f} s), plain file write "
        f"{result['file_write_gbps']:.3f} GB/s ({result['file_write_s']:.2f} s): {result['persist_vs_file']:.2f}x",
    ])
