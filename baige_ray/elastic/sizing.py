"""Which group sizes a job can run at, and its layout at each: whole data-parallel replicas, same global batch."""

from __future__ import annotations

import dataclasses

from baige_ray.engines.train_job import TrainJob
from baige_ray.parallel.layout import ParallelLayout


def replica_size(layout: ParallelLayout) -> int:
    return layout.tp * layout.pp * layout.cp


def valid_sizes(job: TrainJob, layout: ParallelLayout, min_workers: int, max_workers: int) -> tuple[int, ...]:
    """Sizes in [min, max] made of whole replicas whose data-parallel degree splits the global batch,
    evenly or, for pure data parallel jobs, in shares that differ by at most one sequence; with context
    parallelism, also one replica at each smaller CP degree the job can run (see `layout_for`)."""
    sizes = []
    unit = replica_size(layout)
    for size in range(unit, max_workers + 1, unit):
        if size < min_workers:
            continue
        if _splits_evenly(job, size // unit) or _allows_uneven_shares(job, layout, size // unit):
            sizes.append(size)
    smaller = [replica_size(dataclasses.replace(layout, cp=cp)) for cp in smaller_context_parallel(job, layout)]
    return tuple(sorted({*sizes, *(size for size in smaller if min_workers <= size <= max_workers)}))


def smaller_context_parallel(job: TrainJob | None, layout: ParallelLayout) -> list[int]:
    """CP degrees below the layout's, largest first, that divide it and that the job's model can run (its
    sequence splits into 2 x cp chunks; Ulysses' heads divide): each a replica of fewer workers when
    fewer than one replica at the layout's CP are left. The CP degree holds no state between steps."""
    degrees = []
    for cp in range(layout.cp - 1, 0, -1):
        if layout.cp % cp:
            continue
        try:
            if job is not None:
                job.plugin.check_layout(dataclasses.replace(layout, dp=1, cp=cp))
        except ValueError:
            continue
        degrees.append(cp)
    return degrees


def layout_for(layout: ParallelLayout, num_workers: int, job: TrainJob | None = None) -> ParallelLayout:
    """The same tensor/pipeline shape with as many data-parallel replicas as `num_workers` holds; with
    the job given, a global batch that does not split evenly gets shares that differ by one sequence.
    Fewer workers than one replica of a context-parallel layout run one replica at a smaller CP degree
    (CP4 on 4 workers, one lost: CP2 on 2), each rank then holding more of every sequence."""
    unit = replica_size(layout)
    if num_workers < unit:
        for cp in smaller_context_parallel(job, layout):
            if num_workers == replica_size(dataclasses.replace(layout, cp=cp)):
                return dataclasses.replace(layout, dp=1, cp=cp, dp_microbatches=None)
    if num_workers % unit:
        raise ValueError(f"num_workers={num_workers} is invalid: expected a multiple of tp x pp x cp = {unit}")
    dp = num_workers // unit
    if job is not None and not _splits_evenly(job, dp) and _allows_uneven_shares(job, layout, dp):
        shares = even_shares(job.train.global_batch_size // (job.train.micro_batch_size or 1), dp)
        return dataclasses.replace(layout, dp=dp, dp_microbatches=shares)
    return dataclasses.replace(layout, dp=dp, ep=expert_parallel_for(layout.ep, dp, job), dp_microbatches=None)


def expert_parallel_for(preferred: int, dp: int, job: TrainJob | None) -> int:
    """The largest EP degree up to `preferred` that divides `dp` and the model's expert count: a resize
    keeps the experts as sharded as the new data-parallel degree allows."""
    for ep in range(min(preferred, dp), 1, -1):
        if dp % ep:
            continue
        try:
            if job is not None:
                job.plugin.check_expert_parallel(ep)
        except ValueError:
            continue
        return ep
    return 1


def even_shares(total: int, parts: int) -> tuple[int, ...]:
    """`total` split into `parts` that differ by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return tuple(base + 1 if index < extra else base for index in range(parts))


def _splits_evenly(job: TrainJob, dp: int) -> bool:
    try:
        job.train.per_worker_batch(dp)
    except ValueError:
        return False
    return True


def _allows_uneven_shares(job: TrainJob, layout: ParallelLayout, dp: int) -> bool:
    """Uneven shares are a DDP feature of the shared engines, counted in whole micro-batches (sequences
    without a micro-batch size), at least one per replica. Not with expert parallelism: a size that
    needs them would replicate every expert on every rank, which the job's memory may not hold."""
    micro = job.train.micro_batch_size or 1
    return (job.plugin.supports_uneven_data_parallel and layout.tp == layout.pp == 1 and layout.ep == 1
            and layout.data_parallel == "ddp"
            and job.train.global_batch_size % micro == 0 and dp <= job.train.global_batch_size // micro)
